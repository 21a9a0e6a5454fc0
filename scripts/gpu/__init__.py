"""Checks that need a GPU machine: NCCL creation paths, NCCL options, training on CUDA (docs/results/gpus.md)."""
