"""CLI: `python datasets/build_synthetic.py --help`. Same as `python -m knapray.corpus.synthetic`;
the corpus format is described in datasets/README.md."""

import sys

from knapray.corpus.synthetic import main

if __name__ == "__main__":
    sys.exit(main())
