"""``python -m megahash.accelerator`` prints DeepSpeed's name of this machine's accelerator (``DS_ACCELERATOR``
of launch/quickstart.sh: named, DeepSpeed's launcher does not warn that it fell back to CPU)."""

from megahash.accelerator.policy import deepspeed_accelerator

print(deepspeed_accelerator())
