"""Train the embedded default model: a tiny DeepSeek-V3 that adds numbers and reverses words.

The model is transformers' own ``DeepseekV3ForCausalLM`` (MLA with q-LoRA, one dense layer, then
MoE layers with a shared expert and the ``noaux_tc`` sigmoid router), trained from scratch on the
CPU on the task of :mod:`moeserve.models.tiny_chat`, in DeepSeek's chat format. It is saved with
``save_pretrained`` next to the tiny tokenizer, which is exactly what the engine loads.

The router's ``e_score_correction_bias`` gets no gradient; as in DeepSeek-V3's auxiliary-loss-free
balancing, after every step it moves by ``--bias-update-speed`` towards under-used experts.

Batches are drawn fresh each step and never hold a held-out prompt; a curriculum (see
:class:`Curriculum`) shifts them towards additions with short operands once the common case is
learned. Greedy accuracy on held-out prompts, measured with ``model.generate``, is reported as
training goes and at the end; an answer counts only when eos follows it.

Everything is seeded (``--seed``), but CPU thread counts (``--threads``) change the order of
floating-point sums, so another thread count gives other exact weights; the accuracy does not
depend on it. Reproduce the shipped ``moeserve/assets/tiny-chat/`` (about 9-11 minutes on two
CPU cores) from the repository root with::

    python tools/train_tiny_chat.py          # PYTHONPATH=. if moeserve is not installed

``--mtp-only`` then gives that checkpoint a multi-token-prediction (MTP) module, the draft model of
moeserve's speculative decoding (``--speculative-algorithm NEXTN``): the model stays frozen, the
module (see :class:`MTPModule`) learns the token after next on the same task, and is added to
``model.safetensors`` in DeepSeek-V3's released layout (``model.layers.4.*``,
``num_nextn_predict_layers: 1``). The model's own tensors stay byte for byte: moeserve without
speculation and transformers load the same model as before (transformers lists the module's
tensors as unexpected, since its DeepSeek-V3 expects MTP tensors only as the released layer 61).
It ends by measuring moeserve's mean accept length on the held-out prompts, greedy: 1.78 with one
draft, of 2 at most (1.80 on these short answers, since a request that ends on an accepted draft
gains a single token in its last step). About 2 minutes on one CPU thread (1.6 of them training)::

    python tools/train_tiny_chat.py --mtp-only --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Model, PreTrainedTokenizerFast
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

from moeserve.models.tiny import ASSISTANT, USER, write_tiny_tokenizer
from moeserve.models.tiny_chat import embedded_model_path, held_out_prompts, is_correct, make_example

IGNORE = -100  # labels the loss skips: the prompt and the padding
MAX_NEW_TOKENS = 12  # the longest answer is 8 letters then eos; room to see a model that fails to stop


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=embedded_model_path(), help="where to save the checkpoint")
    p.add_argument("--mtp-only", action="store_true",
                   help="train only a multi-token-prediction module for the checkpoint in --out, which stays "
                        "frozen, and add the module to it")
    p.add_argument("--steps", type=int, help="default: 2400, or 1000 with --mtp-only")
    p.add_argument("--batch-size", type=int, help="default: 128, or 64 with --mtp-only")
    p.add_argument("--lr", type=float, help="peak learning rate; default: 1e-3, or 3e-3 with --mtp-only")
    p.add_argument("--warmup", type=int, help="linear warm-up steps; default: 100, or 50 with --mtp-only")
    p.add_argument("--short-operands", type=float, default=0.15,
                   help="the chance that an operand's digit count, not its value, is drawn uniformly")
    p.add_argument("--focus-after-loss", type=float, default=0.15,
                   help="switch to the focus mix once the smoothed training loss is below this")
    p.add_argument("--focus-addition-share", type=float, default=0.75, help="share of additions when focused")
    p.add_argument("--focus-short-operands", type=float, default=0.5,
                   help="--short-operands once focused")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--bias-update-speed", type=float, default=1e-3, help="router bias step per update")
    p.add_argument("--eval-every", type=int, default=400, help="steps between held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="train elsewhere (e.g. cuda) to try settings quickly")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config value, e.g. --set hidden_size=160 (value parsed as JSON)")
    args = p.parse_args()
    for key, value in MODE_DEFAULTS[args.mtp_only].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# Training the whole model, and only its MTP module (``--mtp-only``): the module is one layer
# learning from a trained model's hidden states, so it needs far fewer and smaller steps.
MODE_DEFAULTS: dict[bool, dict[str, Any]] = {
    False: {"steps": 2400, "batch_size": 128, "lr": 1e-3, "warmup": 100},
    True: {"steps": 1000, "batch_size": 64, "lr": 3e-3, "warmup": 50},
}


def model_config(tokenizer: Any, overrides: list[str]) -> DeepseekV3Config:
    """The tiny DeepSeek-V3: 4 layers (1 dense, 3 MoE with 8 routed experts, top-2, 1 shared)."""
    settings = dict(
        vocab_size=_round_up(len(tokenizer), 16),
        hidden_size=128, intermediate_size=384, moe_intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        # Four groups of two, the best two groups eligible: V3's group-limited routing in miniature.
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
        tie_word_embeddings=False, initializer_range=0.02,
        num_nextn_predict_layers=0,  # no multi-token-prediction layer is trained or saved
    )
    for item in overrides:
        key, value = item.split("=", 1)
        settings[key] = json.loads(value)
    return DeepseekV3Config(**settings)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def encode(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of one chat turn and its labels: only the answer and the closing eos are learned.

    Built from pieces because the Rust tokenizer is much faster than rendering the chat template;
    :func:`check_encoding` pins the two to the same ids.
    """
    prompt_ids = encode_prompt(tokenizer, prompt)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, [IGNORE] * len(prompt_ids) + answer_ids


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """bos, User, the prompt, Assistant: the chat template with ``add_generation_prompt``."""
    user, assistant = tokenizer.convert_tokens_to_ids([USER, ASSISTANT])
    body = tokenizer.encode(prompt, add_special_tokens=False)
    return [tokenizer.bos_token_id, user, *body, assistant]


def check_encoding(tokenizer: Any, rng: random.Random) -> None:
    """Fail fast if :func:`encode` ever drifts from the tokenizer's chat template."""
    for _ in range(20):
        prompt, answer = make_example(rng)
        turn = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        expected = _template_ids(tokenizer, turn, add_generation_prompt=False)
        if encode(tokenizer, prompt, answer)[0] != expected:
            raise AssertionError(f"encode() disagrees with the chat template on {prompt!r}")
        if encode_prompt(tokenizer, prompt) != _template_ids(tokenizer, turn[:1], add_generation_prompt=True):
            raise AssertionError(f"encode_prompt() disagrees with the chat template on {prompt!r}")


def _template_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def make_batch(tokenizer: Any, rng: random.Random, batch_size: int, mix: Mix) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh examples, right-padded: causal attention never lets a real token see the padding after
    it, and every row starts at position 0 exactly as at inference. Returns ``input_ids, labels``
    of shape ``[B, T]``."""
    rows = [encode(tokenizer, *make_example(rng, mix.addition_share, mix.short_operands))
            for _ in range(batch_size)]
    return pad_rows(rows, tokenizer.eos_token_id)


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` rows right-padded (``pad_id``, ``IGNORE``) into ``input_ids, labels [B, T]``."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), IGNORE)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, labels


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class RouterBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing for transformers' routers.

    Forward hooks count how many tokens each router sends to each expert; :meth:`update` then
    nudges ``e_score_correction_bias`` up for experts below the mean load and down for those above.
    """

    def __init__(self, model: torch.nn.Module, speed: float) -> None:
        self.speed = speed
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.loads = {id(r): torch.zeros_like(r.e_score_correction_bias) for r in self.routers}
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router: torch.nn.Module, _inputs: Any, outputs: tuple[torch.Tensor, ...]) -> None:
        if router.training:
            topk_indices = outputs[2]  # [T, top_k]
            self.loads[id(router)] += torch.bincount(topk_indices.flatten(), minlength=router.num_experts)

    @torch.no_grad()
    def update(self) -> float:
        """Apply one bias step and reset the counts; returns the worst max/mean load ratio seen."""
        worst = 0.0
        for router in self.routers:
            load = self.loads[id(router)]
            router.e_score_correction_bias += self.speed * torch.sign(load.mean() - load)
            worst = max(worst, (load.max() / load.mean().clamp(min=1)).item())
            load.zero_()
        return worst


@torch.no_grad()
def greedy_completions(model: DeepseekV3ForCausalLM, tokenizer: Any, prompts: list[str]) -> dict[str, tuple[str, bool]]:
    """prompt -> (greedy completion text, whether eos ended it).

    Prompts are batched by token length so no padding is needed and positions match the engine's.
    """
    by_length: dict[int, list[tuple[str, list[int]]]] = defaultdict(list)
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt)
        by_length[len(ids)].append((prompt, ids))
    completions = {}
    for group in by_length.values():
        input_ids = torch.tensor([ids for _, ids in group], device=model.device)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)
        for (prompt, _), new in zip(group, out[:, input_ids.shape[1]:].tolist()):
            completions[prompt] = (tokenizer.decode(new, skip_special_tokens=True), tokenizer.eos_token_id in new)
    return completions


def evaluate(model: DeepseekV3ForCausalLM, tokenizer: Any,
             pairs: list[tuple[str, str]]) -> tuple[dict[str, float], list[str]]:
    """Greedy accuracy over all ``pairs`` and per skill, and the failures as readable lines.

    An answer counts when it is right and followed by eos, so that generation stops by itself.
    """
    model.eval()
    completions = greedy_completions(model, tokenizer, [prompt for prompt, _ in pairs])
    model.train()
    correct: dict[str, list[bool]] = defaultdict(list)
    failures = []
    for prompt, answer in pairs:
        text, stopped = completions[prompt]
        ok = stopped and is_correct(prompt, text)
        correct["addition" if prompt.startswith("What is") else "reversal"].append(ok)
        if not ok:
            failures.append(f"{prompt!r}: expected {answer!r}, got {text!r}{'' if stopped else ' (no eos)'}")
    correct["all"] = correct["addition"] + correct["reversal"]
    return {skill: sum(ok) / len(ok) for skill, ok in correct.items()}, failures


def _report(accuracy: dict[str, float]) -> str:
    return ", ".join(f"{skill} {acc:.3f}" for skill, acc in sorted(accuracy.items()))


@dataclass(frozen=True)
class Mix:
    """What a batch holds: the share of additions, and of operands whose digit count is drawn
    first (see :func:`make_example`)."""

    addition_share: float
    short_operands: float


class Curriculum:
    """Two phases: the task mix with a few extra short operands, then a focus on addition.

    Uniform operands are 3-digit nine times in ten. Trained on those alone, the model learned
    carries but kept failing when the second operand was short (it probably found the first
    operand's digits at a fixed distance, which a shorter second operand moves); a few short
    operands from the start (``--short-operands``) prevented that, while many of them from the
    start slowed learning in our runs. Reversal is learned long before addition, so once the
    smoothed training loss says the common case is learned, batches switch to more additions
    with more short operands.
    """

    def __init__(self, first: Mix, focus: Mix, switch_loss: float) -> None:
        self.mix, self.focus, self.switch_loss = first, focus, switch_loss
        self.smoothed_loss = math.inf

    def observe(self, loss: float) -> bool:
        """Track one step's loss; True on the step that switches to the focus mix."""
        if math.isfinite(self.smoothed_loss):
            self.smoothed_loss = 0.98 * self.smoothed_loss + 0.02 * loss
        else:
            self.smoothed_loss = loss
        if self.mix != self.focus and self.smoothed_loss < self.switch_loss:
            self.mix = self.focus
            return True
        return False


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not embeddings, norms or the router bias)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98))


def train(args: argparse.Namespace, model: DeepseekV3ForCausalLM, tokenizer: Any,
          eval_pairs: list[tuple[str, str]]) -> None:
    """``args.steps`` steps on fresh batches, reporting held-out accuracy every ``args.eval_every``."""
    rng = random.Random(args.seed)
    optimizer = make_optimizer(model, args)
    balancer = RouterBalancer(model, args.bias_update_speed)
    focus = Mix(args.focus_addition_share, args.focus_short_operands)
    curriculum = Curriculum(Mix(0.5, args.short_operands), focus, args.focus_after_loss)
    model.train()
    bar = tqdm(range(args.steps), desc="train", mininterval=2.0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        input_ids, labels = (t.to(args.device) for t in make_batch(tokenizer, rng, args.batch_size, curriculum.mix))
        loss = train_step(model, optimizer, input_ids, labels)
        imbalance = balancer.update()
        bar.set_postfix(loss=f"{loss:.4f}", imbalance=f"{imbalance:.2f}", refresh=False)
        if curriculum.observe(loss):
            bar.write(f"step {step + 1}: smoothed loss {curriculum.smoothed_loss:.3f}, switching to {focus}")
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            accuracy, _ = evaluate(model, tokenizer, eval_pairs)
            bar.write(f"step {step + 1}: loss {loss:.4f}, held-out accuracy: {_report(accuracy)}")


def train_step(model: DeepseekV3ForCausalLM, optimizer: torch.optim.Optimizer,
               input_ids: torch.Tensor, labels: torch.Tensor) -> float:
    """One AdamW step on a ``[B, T]`` batch; returns the mean loss over the labelled tokens."""
    return descend(model, optimizer, model(input_ids=input_ids, labels=labels).loss)


def descend(module: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """Back-propagate ``loss``, clip ``module``'s gradient norm to 1 and step; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def save(model: DeepseekV3ForCausalLM, out_dir: str) -> None:
    """Weights and configs by ``save_pretrained``, then the tokenizer they were trained with."""
    os.makedirs(out_dir, exist_ok=True)
    model.generation_config.pad_token_id = None  # the engine stops on eos; nothing needs padding
    model.to("cpu").save_pretrained(out_dir, safe_serialization=True)
    write_tiny_tokenizer(out_dir)


# ---- the multi-token-prediction module (--mtp-only) ---------------------------------------------


class MTPModule(torch.nn.Module):
    """DeepSeek-V3's multi-token-prediction (MTP) module, as trained here.

    At position ``i`` it reads the frozen model's final-norm hidden state ``H_i`` and the token
    ``t_{i+1}``; through the model's LM head its output predicts ``t_{i+2}``. That is
    ``eh_proj([enorm(embed(t_{i+1})); hnorm(H_i)])``, then one MoE decoder layer (causal attention
    over the module's own positions, rope positions ``i``) and ``shared_head.norm``. The layer and
    that norm are transformers' one-layer ``DeepseekV3Model`` fed ``inputs_embeds`` (its embedding
    is unused), so that transformers itself writes them in the checkpoint's layout (:func:`mtp_tensors`).
    """

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(h, eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        torch.nn.init.normal_(self.eh_proj.weight, std=config.initializer_range)
        block = copy.deepcopy(config)
        block.num_hidden_layers, block.first_k_dense_replace, block.num_nextn_predict_layers = 1, 0, 0
        self.block = DeepseekV3Model(block)
        self.block.embed_tokens.requires_grad_(False)
        self.block.set_experts_implementation("eager")

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """``hidden [B, T, D]`` (``H_i``) and ``next_embeds [B, T, D]`` (the embedding of
        ``t_{i+1}``) -> ``[B, T, D]``, after ``shared_head.norm``."""
        x = torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1)  # [B, T, 2D]
        return self.block(inputs_embeds=self.eh_proj(x)).last_hidden_state


def mtp_logits(model: DeepseekV3ForCausalLM, mtp: MTPModule, input_ids: torch.Tensor) -> torch.Tensor:
    """The module's logits ``[B, T-1, V]`` at positions 0..T-2 of ``input_ids [B, T]``: from the
    frozen model's hidden states there and the embeddings of tokens 1..T-1."""
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]  # [B, T-1, D], after the final norm
        next_embeds = model.model.embed_tokens(input_ids[:, 1:])  # [B, T-1, D]
    return model.lm_head(mtp(hidden, next_embeds))


def next_next_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels [B, T]`` -> the module's ``[B, T-1]``: position ``i`` learns token ``i + 2``."""
    return torch.nn.functional.pad(labels[:, 2:], (0, 1), value=IGNORE)


def train_mtp(args: argparse.Namespace, model: DeepseekV3ForCausalLM, mtp: MTPModule, tokenizer: Any,
              eval_pairs: list[tuple[str, str]]) -> None:
    """``args.steps`` steps of the next-next-token loss on fresh batches of the task mix."""
    rng = random.Random(args.seed)
    optimizer = make_optimizer(mtp, args)
    balancer = RouterBalancer(mtp, args.bias_update_speed)
    mix = Mix(0.5, args.short_operands)
    mtp.train()
    bar = tqdm(range(args.steps), desc="train mtp", mininterval=2.0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        input_ids, labels = (t.to(args.device) for t in make_batch(tokenizer, rng, args.batch_size, mix))
        logits = mtp_logits(model, mtp, input_ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), next_next_labels(labels).flatten(),
                                                 ignore_index=IGNORE)
        loss = descend(mtp, optimizer, loss)
        imbalance = balancer.update()
        bar.set_postfix(loss=f"{loss:.4f}", imbalance=f"{imbalance:.2f}", refresh=False)
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            bar.write(f"step {step + 1}: loss {loss:.4f}, held-out draft agreement "
                      f"{draft_agreement(model, mtp, tokenizer, eval_pairs):.3f}")


@torch.no_grad()
def draft_agreement(model: DeepseekV3ForCausalLM, mtp: MTPModule, tokenizer: Any,
                    pairs: list[tuple[str, str]]) -> float:
    """How often the module's greedy token for position ``i + 2`` is the frozen model's greedy token
    there (what a verify step checks), over the answers of ``pairs``, teacher-forced."""
    mtp.eval()
    input_ids, labels = (t.to(model.device) for t in
                         pad_rows([encode(tokenizer, *pair) for pair in pairs], tokenizer.eos_token_id))
    drafts = mtp_logits(model, mtp, input_ids).argmax(-1)  # [B, T-1]
    targets = model(input_ids=input_ids).logits[:, 1:].argmax(-1)  # [B, T-1]: the model's token i + 2
    mtp.train()
    scored = next_next_labels(labels) != IGNORE
    return (drafts == targets)[scored].float().mean().item()


def mtp_tensors(model: DeepseekV3ForCausalLM, mtp: MTPModule) -> dict[str, torch.Tensor]:
    """The module under DeepSeek-V3's released names, ``model.layers.{num_hidden_layers}.*``.

    The decoder layer and its norm go through transformers' ``save_pretrained`` (experts one by
    one, as in the rest of the checkpoint): ``layers.0.*`` becomes the prefix's, ``norm.weight``
    ``shared_head.norm.weight``. The released layout also repeats the model's embedding and LM head.
    """
    prefix = mtp_prefix(model.config)
    with tempfile.TemporaryDirectory() as tmp:
        mtp.block.save_pretrained(tmp, safe_serialization=True)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    layer = {name for name in saved if name.startswith("layers.0.")}
    if set(saved) - layer != {"norm.weight", "embed_tokens.weight"}:
        raise AssertionError(f"unexpected tensors from the one-layer model: {sorted(set(saved) - layer)}")
    tensors = {prefix + name.removeprefix("layers.0."): saved[name] for name in layer}
    tensors.update({
        prefix + "enorm.weight": mtp.enorm.weight, prefix + "hnorm.weight": mtp.hnorm.weight,
        prefix + "eh_proj.weight": mtp.eh_proj.weight, prefix + "shared_head.norm.weight": saved["norm.weight"],
        prefix + "embed_tokens.weight": model.model.embed_tokens.weight,
        prefix + "shared_head.head.weight": model.lm_head.weight,
    })
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}


def mtp_prefix(config: DeepseekV3Config) -> str:
    """Where the released checkpoint keeps the MTP module: the layer after the model's last."""
    return f"model.layers.{config.num_hidden_layers}."


def add_mtp(out_dir: str, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
    """Add the module's ``tensors`` (all named ``prefix``...) to the checkpoint in ``out_dir``, in
    place of any there, and set ``num_nextn_predict_layers: 1``; the other tensors are rewritten
    byte for byte."""
    path = os.path.join(out_dir, "model.safetensors")
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    kept = {name: t for name, t in load_file(path).items() if not name.startswith(prefix)}
    save_file({**kept, **tensors}, path + ".tmp", metadata=metadata)
    shutil.copymode(path, path + ".tmp")
    os.replace(path + ".tmp", path)  # a new file: the frozen model's weights may still be mapped from the old one
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(config_path, "w") as f:  # as save_pretrained writes it
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def accept_lengths(path: str, prompts: list[str], steps: list[int]) -> dict[int, float]:
    """moeserve's mean accept length with ``NEXTN`` for each of ``steps``, greedy, over the chat
    ``prompts``; fails if a greedy output differs from decoding without speculation."""
    from moeserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0)

    def run(**spec: Any) -> tuple[list[list[int]], float]:
        llm = LLM(path, **spec)
        ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in prompts]
        outs = llm.generate(ids, params, use_tqdm=False)
        return [o.token_ids for o in outs], llm.scheduler.spec.accept_length if spec else 0.0

    plain, _ = run()
    lengths = {}
    for n in steps:
        tokens, lengths[n] = run(speculative_algorithm="NEXTN", speculative_num_steps=n)
        if tokens != plain:
            raise AssertionError(f"greedy outputs with {n} speculative steps differ from those without")
    return lengths


def main_mtp(args: argparse.Namespace) -> None:
    """``--mtp-only``: train a module for the frozen checkpoint in ``args.out`` and add it there."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out)
    check_encoding(tokenizer, random.Random(args.seed + 1))
    model = DeepseekV3ForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval().requires_grad_(False)
    model.set_experts_implementation("eager")
    torch.manual_seed(args.seed)
    mtp = MTPModule(model.config).float()
    model.to(args.device)
    mtp.to(args.device)
    print(f"{sum(p.numel() for p in mtp.parameters() if p.requires_grad) / 1e6:.2f}M MTP parameters")
    eval_pairs = held_out_prompts(args.eval_prompts, seed=args.seed)
    start = time.perf_counter()
    train_mtp(args, model, mtp, tokenizer, eval_pairs)
    minutes = (time.perf_counter() - start) / 60
    agreement = draft_agreement(model, mtp, tokenizer, eval_pairs)
    add_mtp(args.out, mtp_prefix(model.config), mtp_tensors(model, mtp))
    lengths = accept_lengths(args.out, [p for p, _ in eval_pairs], [1, 2, 3])
    print(f"trained the MTP module {args.steps} steps in {minutes:.1f} min; held-out draft agreement "
          f"{agreement:.3f}; moeserve's mean accept length (greedy, {len(eval_pairs)} held-out prompts) "
          + ", ".join(f"{n} step{'s' * (n > 1)}: {v:.3f}" for n, v in lengths.items()) + f"; saved to {args.out}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.mtp_only:
        main_mtp(args)
        return
    with tempfile.TemporaryDirectory() as tmp:  # the output folder is written only once trained
        tokenizer = write_tiny_tokenizer(tmp)
    check_encoding(tokenizer, random.Random(args.seed + 1))
    model = DeepseekV3ForCausalLM(model_config(tokenizer, args.set)).float()
    # The per-expert loop beats grouped_mm for these tiny experts on a CPU (about 2.5x per step).
    model.set_experts_implementation("eager")
    model.to(args.device)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    eval_pairs = held_out_prompts(args.eval_prompts, seed=args.seed)
    start = time.perf_counter()
    train(args, model, tokenizer, eval_pairs)
    minutes = (time.perf_counter() - start) / 60
    save(model, args.out)
    accuracy, failures = evaluate(model, tokenizer, eval_pairs)
    print("\n".join(["failures:", *failures]) if failures else "no failures")
    print(f"trained {args.steps} steps in {minutes:.1f} min; held-out accuracy on {len(eval_pairs)} prompts: "
          f"{_report(accuracy)}; saved to {args.out}")


if __name__ == "__main__":
    main()
