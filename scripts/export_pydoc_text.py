"""Write CPython's reference documentation (shipped in the standard library as ``pydoc_data.topics``) as a
``.jsonl`` file of human-written text, one topic a line, for offline runs on real prose:

    python scripts/export_pydoc_text.py OUT_FOLDER
    python train.py ... --training.dataset text --training.dataset_path OUT_FOLDER
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from pydoc_data.topics import topics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_folder", type=Path)
    folder = parser.parse_args().out_folder
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "python_reference.jsonl"
    with open(path, "w") as out:
        for name in sorted(topics):
            out.write(json.dumps({"text": topics[name]}) + "\n")
    print(f"wrote {len(topics)} topics, {sum(len(t) for t in topics.values())} characters to {path}")


if __name__ == "__main__":
    main()
