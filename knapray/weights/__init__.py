"""Pretrained weights in and trained weights out, in the layouts of the reference
implementations (diffusers, BFL): ``source`` reads a checkpoint's config and headers,
``checks`` decides its family and validates it before workers start, ``load`` streams it
into a (sharded) model, ``export`` writes a run's weights as a diffusers directory."""
