"""One softmax attention map shared by a whole batch ([Xue25] eq. 4.9-4.12)."""
