"""One softmax attention map shared by a whole batch (thesis eq. 4.9-4.12)."""
