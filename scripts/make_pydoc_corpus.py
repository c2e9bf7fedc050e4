"""Write CPython's language reference (shipped with every Python as ``pydoc_data.topics``) as a jsonl corpus.

    python scripts/make_pydoc_corpus.py outputs/pydoc_topics.jsonl
    ./run_llama_train.sh --training.dataset text --training.dataset_path outputs/pydoc_topics.jsonl

Human-written English prose and code (about 465k characters, one document per help topic, in topic order), for
trying optimizers on real text with no network. The text is the Python Software Foundation's documentation, under
the PSF licence; it is generated on the user's machine, not shipped with this project.
"""

import json
import sys
from pathlib import Path
from pydoc_data.topics import topics


def main(out: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for name in sorted(topics):
            f.write(json.dumps({"text": topics[name].strip()}) + "\n")
    print(f"wrote {len(topics)} documents, {sum(len(t) for t in topics.values()):,} characters to {path}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/make_pydoc_corpus.py OUT.jsonl")
    main(sys.argv[1])
