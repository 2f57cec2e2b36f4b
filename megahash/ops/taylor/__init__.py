"""Based's second-order Taylor kernel (thesis eq. 4.6; Arora et al. 2024)."""
