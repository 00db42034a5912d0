"""PyTorch frontend for funshard (FSDP2 API on the funshard core); not implemented yet."""
