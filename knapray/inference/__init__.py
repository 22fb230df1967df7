"""What sampling a trained model needs besides the model and its sampler
(``knapray/models/sampling.py``): requests and their sizes (``requests``), the conditioning
and decoding a corpus records (``conditioning``), and the pictures made of the results
(``images``). ``knapray sample`` and the validation samples drawn while training share them."""
