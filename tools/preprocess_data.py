#!/usr/bin/env python
"""Tokenize JSON lines into Megatron-LM ``.bin/.idx`` files (same flags, same bytes).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \\
        --output-prefix data/corpus --append-eod --workers 4
    # -> data/corpus_text_document.bin / .idx

See docs/data.md; the engine is megalite/data/preprocess.py.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megalite.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    main()
