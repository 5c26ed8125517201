"""Known models' config.json files, so `cpumla info` and planning work before a download.

Each file is the repository's real config.json, named `<org>--<name>.json` (the Hugging Face
cache's spelling). Deviations: Moonlight's files carry an explicit `"rope_scaling": null` (the
published files omit the key), so that `--hf-overrides '{"rope_scaling": {...}}'` is accepted.
"""

from pathlib import Path

DIR = Path(__file__).parent
