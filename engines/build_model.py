"""Build the tiny model the real-engine tests and benchmarks serve: no model can be downloaded here.

A random-weight Llama (hidden 256, 2 layers, 4 heads of head_dim 64 as vLLM's CPU attention requires, 16K
positions, bf16: ~3M parameters) with a byte-level BPE tokenizer (vocab 4096) trained on a seeded synthetic
corpus of English and code words, a ChatML chat template, and two random LoRA adapters (r 8). Everything is
seeded, so the same script and library versions give the same files; the output directory is named by a hash of
both, and an existing complete one is reused.

Run with the engine's own Python (``make engines``): it needs torch, transformers, tokenizers and peft, which the
product never imports. Prints the model directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

SEED = 20261201
VOCAB = 4096
ADAPTERS = ("tiny-lora-a", "tiny-lora-b")
SERVED_NAME = "tiny-llama"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# what the corpus is drawn from: the words of coding agents' prompts (English, code, tool output)
WORDS = """the a an of to and in is it that for on with as are be this by from or at not you your we can will
if then else when while return def class import self none true false function value values file files line
lines code test tests error errors output input request response model router replica cache prefix token tokens
session project rule rules agent tool call result results context system user assistant message content list dict
string int float bool print run build make install config path name names data time count size first last next
new old add remove update read write open close start stop check fix bug issue change diff patch commit branch
merge main version module package function method argument arguments parameter type types object objects key keys
map set get put post header headers body json yaml http server client port host address queue worker task job
please follow these steps use only when needed keep answer short explain why what how where which because after
before into over under between each every some all any more most less least other such same different""".split()  # noqa: SIM905 (a corpus, read as words)


def corpus(n_lines: int, rng: random.Random):
    punct = [". ", ", ", "; ", ": ", "(", ") ", " = ", " == ", "\n", "    ", "{", "}", "[", "]", "_", "-", "/", '"']
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(4, 24)):
            w = rng.choice(WORDS)
            r = rng.random()
            if r < 0.08:
                w = f"{w}{rng.randrange(10_000)}"
            elif r < 0.12:
                w = w.capitalize()
            parts.append(w)
            parts.append(rng.choice(punct) if rng.random() < 0.25 else " ")
        yield "".join(parts)


def fingerprint() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for lib in ("torch", "transformers", "tokenizers", "peft", "safetensors"):
        h.update(f"{lib}=={version(lib)}\n".encode())
    return h.hexdigest()[:16]


def build(out: Path) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the BPE trainer's merges in one order
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(SEED)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(20_000, rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.model_max_length = 16384
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=16384,
                      bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
                      eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=True,
                      torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)

    for k, name in enumerate(ADAPTERS):
        torch.manual_seed(SEED + 1 + k)
        base = LlamaForCausalLM(cfg).to(torch.bfloat16)
        peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                               init_lora_weights=False, task_type="CAUSAL_LM"))
        peft.save_pretrained(out / "adapters" / name)
        conf = out / "adapters" / name / "adapter_config.json"  # peft writes target_modules from a set
        doc = json.loads(conf.read_text())
        doc["target_modules"] = sorted(doc["target_modules"])
        conf.write_text(json.dumps(doc, indent=2, sort_keys=True))
    (out / "warmroute-model.json").write_text(json.dumps(
        {"served_name": SERVED_NAME, "adapters": list(ADAPTERS), "seed": SEED, "vocab": VOCAB}, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=".engines/models", help="where models are kept, one directory per fingerprint")
    args = ap.parse_args()
    cache = Path(args.cache)
    out = cache / f"tiny-llama-{fingerprint()}"
    if not (out / "warmroute-model.json").exists():
        tmp = cache / f".{out.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    current = cache / "current"  # the tests' and `warmroute up --engine vllm`'s way to it
    if not current.is_symlink() or os.readlink(current) != out.name:
        link = cache / ".current.new"
        link.unlink(missing_ok=True)
        link.symlink_to(out.name)
        link.replace(current)
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
