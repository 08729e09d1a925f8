"""Offline tuning: launch settings, time models, PCIe bandwidth, the device profile."""
