"""
Train the tiny Llamas that ship with powerinfer-tools: the sparse ReLU one and a dense SiLU one.

Everything comes from text that exists on every machine with Python:

  corpus     the CPython standard library's .py sources + the pydoc topics
  tokenizer  GPT-2 style byte-level BPE (tokenizers), <|endoftext|> = id 0
  model      transformers.LlamaForCausalLM with a ReGLU FFN
             (down(relu(gate x) * up x)), RMSNorm, RoPE, GQA, tied embeddings
  sparsity   ProSparse-style L1 penalty on relu(gate x) with a per-layer
             coefficient that grows from ~0 until the layer fires on no more
             than a target fraction of its FFN neurons (progressive, adaptive)

--activation silu trains the same model with a SwiGLU FFN (down(silu(gate x) * up x))
and no sparsity penalty at all: a plain dense model, for training-free activation
sparsity methods (CATS, TEAL). Give it --tokenizer examples/tiny-relu-llama to reuse
the ReLU model's tokenizer.json, so both models share one vocabulary (the held-out
split depends only on the corpus, so heldout.txt is the same file).

Output: a Hugging Face folder (config, fp16 safetensors, tokenizer files),
heldout.txt (held-out documents joined by <|endoftext|>) and metrics.json,
whose numbers go into MODEL_CARD.md.

    nice -n 10 python3 examples/train_bundled_model.py --out examples/tiny-relu-llama --minutes 21 --seed 1337
    nice -n 10 python3 examples/train_bundled_model.py --activation silu --tokenizer examples/tiny-relu-llama \
        --out examples/tiny-silu-llama --steps 1312 --seed 1337
"""

import argparse
import hashlib
import json
import math
import os
import platform
import sysconfig
import time

# OpenMP threads that spin while waiting lose badly on a shared, busy machine;
# sleeping waiters cost nothing when idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pydoc_data.topics import topics

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOT = "<|endoftext|>"  # BOS, EOS and document separator, token id 0
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
SAMPLE_PROMPTS = ["def ", "import os\n\ndef main():\n"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output model folder (default: examples/tiny-<activation>-llama)")
    p.add_argument("--activation", choices=("relu", "silu"), default="relu",
                   help="FFN activation: relu = ReGLU with the L1 sparsity penalty; silu = SwiGLU, no penalty (dense)")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="reuse FOLDER/tokenizer.json instead of training one; if FOLDER has a heldout.txt "
                        "it must equal this run's (same corpus and split)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--minutes", type=float, default=21.0,
                   help="wall-clock budget of the optimisation loop (LR and L1 schedules follow elapsed time)")
    p.add_argument("--steps", type=int, default=0,
                   help="train for exactly this many steps instead (schedules follow the step count; reproducible)")
    p.add_argument("--threads", type=int, default=2)
    # data / tokenizer
    p.add_argument("--heldout-permille", type=int, default=30, help="share of documents held out, per mille")
    p.add_argument("--heldout-bytes", type=int, default=300_000, help="size cap of heldout.txt")
    p.add_argument("--vocab-size", type=int, default=4096)
    # model
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--ctx", type=int, default=256)
    # optimisation
    p.add_argument("--batch-size", type=int, default=8, help="token windows per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    # sparsity (--activation relu only)
    p.add_argument("--l1-init", type=float, default=1e-3, help="initial (and minimum) L1 coefficient per layer")
    p.add_argument("--l1-growth", type=float, default=12.0,
                   help="controller speed: log(coefficient) may change by this much over the whole run")
    p.add_argument("--target-fire", type=float, default=0.10, help="per-layer firing fraction the controller aims at")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()
    if args.out is None:
        args.out = f"examples/tiny-{args.activation}-llama"
    return args


# -----------------------------------------------------------------------------
# corpus

def is_heldout(name, permille):
    """Stable split: a document is held out by the SHA-256 of its name."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return h % 1000 < permille


def load_documents():
    """(name, text) for every stdlib .py file and every pydoc topic, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError:
                continue  # not UTF-8 (in CPython 3.11 only test data, already skipped)
            if text.strip():
                docs.append((os.path.relpath(path, root).replace(os.sep, "/"), text))
    docs += [(f"pydoc_data/topics/{k}", topics[k]) for k in sorted(topics)]
    return docs


def split_documents(docs, permille):
    train = [(n, t) for n, t in docs if not is_heldout(n, permille)]
    held = [(n, t) for n, t in docs if is_heldout(n, permille)]
    return train, held


def heldout_sample(held, max_bytes):
    """Held-out documents (in order) that fit in max_bytes when joined by EOT."""
    picked, size = [], 0
    for _, text in held:
        n = len(text.encode()) + len(EOT)
        if size + n <= max_bytes:
            picked.append(text)
            size += n
    return EOT.join(picked)


# -----------------------------------------------------------------------------
# tokenizer

def train_tokenizer(texts, vocab_size):
    """Byte-level BPE exactly in the GPT-2 style (llama.cpp pre-tokenizer "gpt-2")."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(folder, held_text, vocab_size):
    """Another model's tokenizer.json, checked to come from the same corpus split (its heldout.txt)."""
    held_path = os.path.join(folder, "heldout.txt")
    if os.path.exists(held_path):
        with open(held_path, encoding="utf-8") as f:
            if f.read() != held_text:
                raise SystemExit(f"{held_path} differs from this run's held-out text: the tokenizer was "
                                 "trained on a different split (another Python version or --heldout-* options)")
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"{folder}/tokenizer.json has {tok.get_vocab_size()} tokens, --vocab-size is {vocab_size}")
    return tok


def encode_stream(tok, texts):
    """One token stream: EOT doc EOT doc ... (EOT opens every document)."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.append(eot)
        ids.extend(enc.ids)
    return np.array(ids, dtype=np.uint16)


# The model was never trained on conversations: this template only lets chat clients (`pitools serve`'s
# /v1/chat/completions) be tested against it. Each message becomes a Python comment line, the form of
# text it has seen, and the assistant's turn is left open.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('this chat template knows the roles system, user and assistant only') }}{%- endif -%}\n"
    "{{ '# ' + message['role'] + ': ' + message['content'] | trim + '\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '# assistant:' }}{%- endif -%}"
)


def save_tokenizer(tok, out, ctx):
    """tokenizer.json + a transformers config naming EOT as BOS and EOS (never added automatically)."""
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, model_max_length=ctx)
    fast.save_pretrained(out)
    # pin the class and the special-token map so any transformers version reads them back;
    # prompts start with <|endoftext|> (add_bos_token), as every training document did
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", bos_token=EOT, eos_token=EOT,
               add_bos_token=True, add_eos_token=False, model_max_length=ctx, chat_template=CHAT_TEMPLATE)
    write_json(cfg_path, cfg)
    write_json(os.path.join(out, "special_tokens_map.json"), {"bos_token": EOT, "eos_token": EOT})


# -----------------------------------------------------------------------------
# model

def make_config(args, vocab_size, eot_id):
    """A Llama whose FFN is ReGLU, down(relu(gate x) * up x), or SwiGLU with --activation silu."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.d_model,
        intermediate_size=args.d_ff,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        hidden_act=args.activation,
        max_position_embeddings=args.ctx,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
    )


class FFNActivations:
    """Forward hooks on every layer's act_fn: the ReLU output relu(gate x)."""

    def __init__(self, model):
        self.acts = [None] * len(model.model.layers)
        self.handles = [layer.mlp.act_fn.register_forward_hook(self._hook(i))
                        for i, layer in enumerate(model.model.layers)]

    def _hook(self, i):
        def fn(module, inputs, output):
            self.acts[i] = output
        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


# -----------------------------------------------------------------------------
# training

def get_batch(data, batch_size, ctx, gen):
    """batch_size random windows of ctx + 1 tokens -> (inputs, next-token targets)."""
    ix = torch.randint(len(data) - ctx - 1, (batch_size,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + ctx + 1].astype(np.int64)) for i in ix.tolist()])
    return x[:, :-1], x[:, 1:]


def lr_at(step, progress, args):
    """Linear warmup over warmup_steps, then cosine decay to min_lr_ratio * lr as progress goes 0 -> 1."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_progress(args):
    """Training progress in [0, 1]: by step count with --steps (reproducible), else by wall clock."""
    if args.steps:
        return lambda step, seconds: step / args.steps
    return lambda step, seconds: seconds / (args.minutes * 60)


def make_optimizer(model, args):
    """AdamW; weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model, ffn, opt, x, y, l1_coef, args):
    """One step of loss = CE + sum_l coef_l * mean|relu(gate_l x)|. Returns (ce, firing per layer).

    Without activation hooks (ffn None: the SiLU model) the loss is CE alone and firing is None.
    """
    logits = model(input_ids=x).logits
    ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    loss = ce
    if ffn is not None:
        l1 = torch.stack([a.mean() for a in ffn.acts])  # activations are >= 0, so mean == L1 / n
        loss = ce + (l1_coef * l1).sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    opt.step()
    if ffn is None:
        return ce.item(), None
    fire = torch.stack([(a > 0).float().mean() for a in ffn.acts])
    return ce.item(), fire


def train(model, data, args, log):
    gen = torch.Generator().manual_seed(args.seed)  # batch sampling; the model has no dropout
    sparse = args.activation == "relu"  # the L1 penalty and its controller: ReLU only
    ffn = FFNActivations(model) if sparse else None
    opt = make_optimizer(model, args)
    progress = make_progress(args)
    # per-layer L1 coefficients, adapted multiplicatively: log(coef) moves by
    # +-l1_growth * (progress made this step), up while the layer's smoothed
    # firing fraction is above target, down while below, never under l1_init.
    # From l1_init this is a progressive (exponential) ramp that stops where
    # each layer meets the target.
    log_coef = torch.full((args.n_layers,), math.log(args.l1_init))
    fire_ema = None
    step, p, t0 = 0, 0.0, time.time()
    model.train()
    while p < 1:
        lr = lr_at(step, p, args)
        for g in opt.param_groups:
            g["lr"] = lr
        coef = log_coef.exp()
        x, y = get_batch(data, args.batch_size, args.ctx, gen)
        ce, fire = train_step(model, ffn, opt, x, y, coef, args)
        step += 1
        p_next = progress(step, time.time() - t0)
        if sparse:
            fire_ema = fire if fire_ema is None else 0.9 * fire_ema + 0.1 * fire
            log_coef += args.l1_growth * (p_next - p) * torch.sign(fire_ema - args.target_fire)
            log_coef.clamp_(min=math.log(args.l1_init))
        p = p_next
        if step % args.log_every == 1 or p >= 1:
            l1_info = (f"fire {' '.join(f'{f:.3f}' for f in fire_ema.tolist())} | "
                       f"l1 {' '.join(f'{c:.3f}' for c in coef.tolist())} | " if sparse else "")
            log(f"step {step:5d} ({min(p, 1):6.1%}) | ce {ce:.4f} | lr {lr:.2e} | {l1_info}{time.time() - t0:.0f}s")
    if not sparse:
        return {"steps": step, "train_seconds": time.time() - t0, "final_train_ce": ce}
    ffn.remove()
    return {"steps": step, "train_seconds": time.time() - t0, "final_train_ce": ce,
            "final_l1_coef": coef.tolist()}


# -----------------------------------------------------------------------------
# evaluation

def eval_batches(ids, ctx, batch_size=16):
    """(x, y) batches of consecutive non-overlapping ctx windows; the short tail last."""
    ids = torch.from_numpy(ids.astype(np.int64))
    n_full = (len(ids) - 1) // ctx
    x = ids[:n_full * ctx].view(n_full, ctx)
    y = ids[1:n_full * ctx + 1].view(n_full, ctx)
    for i in range(0, n_full, batch_size):
        yield x[i:i + batch_size], y[i:i + batch_size]
    if n_full * ctx < len(ids) - 1:
        yield ids[n_full * ctx:-1][None], ids[n_full * ctx + 1:][None]


@torch.no_grad()
def evaluate(model, ids, ctx):
    """Per-token NLL over non-overlapping ctx windows, plus per-neuron firing counts per layer."""
    model.eval()
    ffn = FFNActivations(model)
    counts = torch.zeros(len(ffn.acts), model.config.intermediate_size, dtype=torch.float64)
    nll, n_tok = 0.0, 0
    for x, y in eval_batches(ids, ctx):
        logits = model(input_ids=x).logits
        nll += F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
        n_tok += y.numel()
        for l, a in enumerate(ffn.acts):
            counts[l] += (a > 0).sum((0, 1)).double()
    ffn.remove()
    return nll / n_tok, counts, n_tok


def sparsity_stats(counts, n_tokens, mass=0.8):
    """Per layer: mean firing fraction, and the fraction of neurons carrying `mass` of all firings."""
    stats = []
    for c in counts:
        fire = c.sum().item() / (n_tokens * len(c))
        cum = torch.cumsum(c.sort(descending=True).values, 0)
        k = int(torch.searchsorted(cum, mass * cum[-1]).item()) + 1
        stats.append({"firing_fraction": fire, "mass80_neuron_fraction": k / len(c)})
    return stats


def unigram_nll(train_ids, held_ids, vocab_size):
    """Cross-entropy of held-out tokens under add-one-smoothed training token frequencies."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[held_ids[1:]].mean())


@torch.no_grad()
def greedy(model, tok, prompt, n_new):
    """Greedy continuation of EOT + prompt (a document start, as in training)."""
    ids = torch.tensor([[tok.token_to_id(EOT)] + tok.encode(prompt).ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                         do_sample=False, pad_token_id=tok.token_to_id(EOT))
    return tok.decode(out[0, ids.size(1):].tolist(), skip_special_tokens=False)


# -----------------------------------------------------------------------------
# output

def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def save_model(model, out, eot_id):
    """fp16 safetensors (the size cap), a generation config, and a top-level rope_theta for older tools."""
    model.to(torch.float16).save_pretrained(out)
    model.to(torch.float32)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    write_json(cfg_path, cfg)
    GenerationConfig(bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id,
                     do_sample=False, max_new_tokens=128).save_pretrained(out)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # corpus + split
    docs = load_documents()
    train_docs, held_docs = split_documents(docs, args.heldout_permille)
    held_text = heldout_sample(held_docs, args.heldout_bytes)
    # tokenizer (a reused one is checked against its folder's heldout.txt before this run writes one)
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer, held_text, args.vocab_size)
        log(f"tokenizer: reused {os.path.join(args.tokenizer, 'tokenizer.json')}")
    else:
        tok = train_tokenizer([t for _, t in train_docs], args.vocab_size)
    with open(os.path.join(args.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(held_text)
    log(f"documents: {len(train_docs)} train, {len(held_docs)} held out; heldout.txt {len(held_text.encode())} bytes")
    eot_id = tok.token_to_id(EOT)
    assert eot_id == 0, eot_id
    save_tokenizer(tok, args.out, args.ctx)
    train_ids = encode_stream(tok, [t for _, t in train_docs])
    held_ids = np.array([eot_id] + tok.encode(held_text).ids, dtype=np.uint16)
    log(f"tokenizer: vocab {tok.get_vocab_size()}; tokens: {len(train_ids)} train, {len(held_ids)} held out")

    # model + training
    model = LlamaForCausalLM(make_config(args, tok.get_vocab_size(), eot_id))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters (tied embeddings)")
    stats = train(model, train_ids, args, log)

    # save, then evaluate the fp16 weights exactly as shipped
    save_model(model, args.out, eot_id)
    log(f"saved to {args.out}")
    model = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    held_nll, counts, n_eval = evaluate(model, held_ids, args.ctx)
    log(f"evaluated {n_eval} held-out tokens")
    uni_nll = unigram_nll(train_ids, held_ids, tok.get_vocab_size())
    # ReLU firing (> 0) is activation sparsity; a SiLU output is almost never exactly 0
    sparsity = sparsity_stats(counts, n_eval) if args.activation == "relu" else None
    samples = {p: greedy(model, tok, p, 96) for p in SAMPLE_PROMPTS}

    metrics = {
        "python_version": platform.python_version(),
        "n_train_docs": len(train_docs), "n_heldout_docs": len(held_docs),
        "n_heldout_txt_docs": held_text.count(EOT) + 1,
        "n_train_tokens": int(len(train_ids)), "n_heldout_tokens": int(len(held_ids)),
        "n_params": n_params, "args": vars(args), **stats,
        "heldout_ppl": math.exp(held_nll), "unigram_ppl": math.exp(uni_nll),
        "heldout_eval_tokens": n_eval, "sparsity": sparsity, "samples": samples,
        "total_seconds": time.time() - t_start,
    }
    write_json(os.path.join(args.out, "metrics.json"), metrics)
    log(f"held-out ppl {metrics['heldout_ppl']:.2f} vs unigram {metrics['unigram_ppl']:.2f}")
    for l, s in enumerate(sparsity or []):
        log(f"layer {l}: firing {s['firing_fraction']:.4f}, 80% mass in {s['mass80_neuron_fraction']:.4f} of neurons")
    for p, s in samples.items():
        log(f"sample {p!r} -> {s!r}")


if __name__ == "__main__":
    main()
