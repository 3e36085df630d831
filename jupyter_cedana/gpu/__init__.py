"""The GPU: NVML's view of who holds which GPU, and the CUDA driver's checkpoint
of a kernel's GPU memory."""
