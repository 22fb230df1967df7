"""Pretrained weights in, in the layouts of the reference implementations (diffusers, BFL):
``source`` reads a checkpoint's config and headers, ``checks`` decides its family and
validates it before workers start (and fingerprints a LoRA run's base), ``load`` streams it
into a (sharded) model. Writing a run's weights out is the driver's (``driver/export.py``,
``driver/lora_export.py``): it reads a run directory."""
