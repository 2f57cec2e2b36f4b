"""[Xue25] Appendix I recurrence: three separately normalised orders (eq. 4.14-4.17)."""
