"""Based's second-order Taylor kernel ([Xue25] eq. 4.6; [Arora24])."""
