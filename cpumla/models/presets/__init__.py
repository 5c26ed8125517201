"""Known models' config.json files, so `cpumla info` and planning work before a download.

Each file is the repository's real config.json, named `<org>--<name>.json` (the Hugging Face
cache's spelling). Deviations: Moonlight's files carry an explicit `"rope_scaling": null` (the
published files omit the key), so that `--hf-overrides '{"rope_scaling": {...}}'` is accepted. The
two V3.2 files (V3.2-Exp and V3.2 share one architecture) carry the published values (V3.1's config
with model_type deepseek_v32, index_n_heads 64, index_head_dim 128, index_topk 2048) in the same
layout, without the remote-code `auto_map`. The two V4 files (Flash, Pro) carry the published V4
values (official keys: `compress_ratios` with the MTP layer's entry, `num_hash_layers`,
`qk_rope_head_dim`, YaRN `rope_scaling` for the compressed layers, FP8 `quantization_config` with
`expert_dtype` fp4) in the same layout. Their -Base files are the same architecture with `expert_dtype`
fp8: the base releases ship the routed experts in FP8 e4m3 with 128x128 E8M0 blocks (about 283 GiB
for Flash-Base against about 160 GB for Flash), which is what `--dummy-weights` then makes; a real
checkpoint is read in whatever format its files hold.
"""

from pathlib import Path

DIR = Path(__file__).parent
