"""Training corpora: parquet shards of latents, text embeddings and length columns.

``schema`` defines the row format and decodes/validates rows; ``synthetic`` builds
corpora from the paper's data codes; ``ingest`` encodes folders of images and videos
(``media`` finds, captions and decodes them, ``stages`` runs the encoders in this process
or in Ray Data actors, ``hf`` adapts diffusers VAEs and T5/CLIP from local directories).
"""

from knapray.corpus.encoders import HashTextEncoder, LatentEncoder, PixelPatchEncoder, TextEncoder
from knapray.corpus.schema import CORPUS_SCHEMA, CorruptSample, decode_row, validate_row
from knapray.corpus.writer import read_corpus, read_schema_json, shard_paths

__all__ = [
    "CORPUS_SCHEMA",
    "CorruptSample",
    "HashTextEncoder",
    "LatentEncoder",
    "PixelPatchEncoder",
    "TextEncoder",
    "decode_row",
    "read_corpus",
    "read_schema_json",
    "shard_paths",
    "validate_row",
]
