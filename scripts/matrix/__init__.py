"""The torch matrix (torch_matrix.py)."""
