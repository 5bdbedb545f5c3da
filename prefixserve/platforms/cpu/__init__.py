"""The CPU platform (platform.py) and the native kernels it is built on (native/)."""
