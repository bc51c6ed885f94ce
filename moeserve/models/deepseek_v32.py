"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3 whose attention layers each carry a
lightning indexer and attend only to the ``index_topk`` earlier tokens it selects
(``layers/indexer.py``). Everything else, MTP included, is V3's."""

from __future__ import annotations

from moeserve.layers.indexer import SparseMLA
from moeserve.models.deepseek import DecoderLayer, DeepseekForCausalLM


class DeepseekV32DecoderLayer(DecoderLayer):
    attention_cls = SparseMLA


class DeepseekV32ForCausalLM(DeepseekForCausalLM):
    decoder_layer = DeepseekV32DecoderLayer
