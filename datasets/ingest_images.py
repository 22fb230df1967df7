"""CLI: `python datasets/ingest_images.py --help`. Same as `python -m knapray.corpus.ingest`;
the corpus format, the encoder flags (--vae, --text-encoder, --pooled-encoder), captions
(metadata.jsonl, sidecar .txt) and the Ray Data path (--workers N) are described in
datasets/README.md."""

import sys

from knapray.corpus.ingest import main

if __name__ == "__main__":
    sys.exit(main())
