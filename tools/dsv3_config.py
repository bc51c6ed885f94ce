"""Write a config.json of DeepSeek-V3's shapes with few layers (1 dense + the rest MoE), for servers
started with ``--load-format dummy`` in the GPU scripts:

    python3 tools/dsv3_config.py /tmp/dsv3-4l [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os

from moeserve.planner import PRESETS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    hf = {k: v for k, v in PRESETS["dsv3"].items() if k != "quantization_config"}
    hf.update(num_hidden_layers=args.layers, first_k_dense_replace=1, architectures=["DeepseekV3ForCausalLM"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf, f)


if __name__ == "__main__":
    main()
