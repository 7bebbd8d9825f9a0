"""Load a Qwen3.5 checkpoint directory as published: config, safetensors weights, tokenizer.

Weights load by name: the multimodal layout keeps the text model under `model.language_model.`
(mapped to our `model.`, also under a text-only config.json, as transformers maps it);
`model.visual.*` and `mtp.*` are ignored. One file or shards with
`model.safetensors.index.json`; tied or untied embeddings; weights stored in a float dtype of
16 bits or more are converted to the requested one. A tensor of another dtype (integers, float8:
a quantized checkpoint) or one the model has no place for is refused with a one-line error.
MoE experts come fused (`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj`
[E, H, I], as the released Qwen3.5-MoE checkpoints hold them) or one tensor per expert
(`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I], as
transformers' save_pretrained writes them by default, and Qwen3-Next-style conversions), which
are copied into their rows of the fused parameters.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import SafetensorError, safe_open

from statechat.errors import ModelError
from statechat.model.config import ModelConfig, transformers_config
from statechat.model.qwen3_5 import Qwen3_5ForCausalLM

IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
# weights of other formats (PyTorch pickles, llama.cpp's GGUF), named when no safetensors is there
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.gguf")
# names of no weight: the lm_head a tied checkpoint may still store, rotary buffers
TOLERATED_SUFFIXES = ("lm_head.weight", "rotary_emb.inv_freq")
PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class LoadedModel:
    """A ready model with its tokenizer and the facts the cache needs to trust it."""

    path: Path
    config: ModelConfig
    model: Qwen3_5ForCausalLM
    tokenizer: object  # a transformers PreTrainedTokenizerBase with a chat template
    dtype: torch.dtype
    device: torch.device
    weights_digest: str  # sha256 of the safetensors headers and the weights (weights_digest)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when it is sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()), key=repr)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelError(f"{index} is not a valid safetensors index (no weight_map)") from None
        files = [path / _shard_name(index, name) for name in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted((p.name for pattern in OTHER_WEIGHTS for p in path.glob(pattern)),
                        key=lambda name: (not name.startswith(("pytorch_model", "model")), name))
        raise ModelError(f"{path} holds no *.safetensors weights" + (
            f" (it has {others[0]}: statechat reads safetensors checkpoints only; download "
            "the model's safetensors release)" if others else ""))
    for f in files:
        if not f.is_file():
            where = "named in the index is missing from" if index.is_file() else "is not a file in"
            raise ModelError(f"weight shard {f.name} {where} {path}")
    return files


def _shard_name(index: Path, name: object) -> str:
    """A shard name of the index, which must name a file inside the checkpoint's directory: a
    relative path with no `..` (an index could otherwise have us read any file we can open).
    The file itself may be a link elsewhere, as in the Hugging Face cache's snapshots."""
    if not isinstance(name, str) or not name:
        raise ModelError(f"{index} names a weight shard that is not a file name: {name!r}")
    parts = PurePosixPath(name.replace("\\", "/"))
    if parts.is_absolute() or PureWindowsPath(name).anchor or ".." in parts.parts:
        raise ModelError(f"{index} names a weight shard outside its directory: {name!r}")
    return name


def map_name(name: str, config: ModelConfig) -> str | None:
    """Checkpoint tensor name -> our parameter name, or None for tensors we ignore. The text
    model's tensors may sit under `model.language_model.` whatever the config.json's layout (a
    multimodal checkpoint given a text-only config.json, which transformers loads too)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def expert_slice(ours: str, params: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """A per-expert tensor's place in our fused expert parameters: (fused name, view), or None.

    `...experts.{e}.gate_proj.weight` -> rows [0, I) of gate_up_proj[e], `up_proj` -> rows
    [I, 2I), `down_proj` -> down_proj[e].
    """
    m = PER_EXPERT.match(ours)
    if m is None:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    fused = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
    param = params.get(fused)
    if param is None or e >= param.shape[0]:
        return None
    if proj == "down_proj":
        return fused, param[e]
    half = param.shape[1] // 2
    return fused, param[e, :half] if proj == "gate_proj" else param[e, half:]


def weights_digest(files: list[Path]) -> str:
    """sha256 of the safetensors headers (every tensor's name, dtype, shape and offsets) and of
    the tensors' bytes: a tensor of up to WHOLE_TENSOR_BYTES whole, a larger one by
    NUM_WINDOWS evenly spaced windows of WINDOW_BYTES (its first and last bytes among them).
    So a checkpoint and its fine-tune (the same shapes, other values) differ in it, while a
    model of many gigabytes is not read a second time (the windows come from the page cache
    the load just filled); a copy of the folder keeps it. Edits of a few values of a large
    tensor, between the windows, go unseen."""
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = fh.read(n)
            h.update(header)
            entries = json.loads(header)
            for name in sorted(k for k in entries if k != "__metadata__"):
                begin, end = entries[name]["data_offsets"]
                for start, size in _sample(end - begin):
                    fh.seek(8 + n + begin + start)
                    h.update(fh.read(size))
    return h.hexdigest()


WHOLE_TENSOR_BYTES = 1 << 20  # a tensor up to this size goes into weights_digest whole
# a larger one: this many windows of this many bytes (16 reads of a tensor: a MoE checkpoint
# of some 18,000 tensors, its experts one tensor each, takes 0.7 s from the page cache)
NUM_WINDOWS, WINDOW_BYTES = 16, 1024


def _sample(length: int) -> list[tuple[int, int]]:
    """The (offset, size) pieces of a tensor of `length` bytes that weights_digest hashes."""
    if length <= WHOLE_TENSOR_BYTES:
        return [(0, length)]
    last = length - WINDOW_BYTES
    return [(i * last // (NUM_WINDOWS - 1), WINDOW_BYTES) for i in range(NUM_WINDOWS)]


@contextlib.contextmanager
def _reading(file: Path) -> Iterator[None]:
    """An unreadable, empty or truncated weights file as one ModelError that names it."""
    try:
        yield
    except OSError as e:
        raise ModelError(f"the weights file {file} cannot be read "
                         f"({e.strerror or type(e).__name__})") from None
    except SafetensorError as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise ModelError(f"the weights file {file} cannot be read ({why}); it is damaged or "
                         "cut short (an interrupted download?): fetch it again") from None


def load_weights(model: Qwen3_5ForCausalLM, files: list[Path], config: ModelConfig) -> None:
    """Copy every checkpoint tensor into `model`; name the first missing, misshapen, unknown or
    non-float tensor."""
    params = dict(model.named_parameters())
    seen = _Seen(nested=config.is_multimodal_layout)
    for f in files:
        with _reading(f), safe_open(f, framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 - safetensors' handle is not iterable
                target = seen.target(name, config, params)
                if target is not None:
                    _copy(name, st.get_tensor(name), target)
    if config.tie_word_embeddings:
        seen.loaded.add("lm_head.weight")
    seen.check_complete(params, config)


@dataclass
class _Seen:
    """What load_weights has met in a checkpoint's files, to name what they lack or add."""

    nested: bool  # the config's layout: the text model's tensors under model.language_model.
    lead: int = 0  # text-model tensors met under model.language_model. less those under model.
    loaded: set[str] = field(default_factory=set)  # our parameters copied whole
    unknown: list[str] = field(default_factory=list)  # tensors the model has no place for
    parts: dict[str, set[str]] = field(default_factory=dict)  # fused -> per-expert tensors met

    def target(self, name: str, config: ModelConfig,
               params: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Where checkpoint tensor `name` goes (a parameter, or its rows of a fused expert
        parameter), noted as met; None for one ignored, tolerated or unknown (noted)."""
        ours = map_name(name, config)
        if ours is None:
            return None
        if ours.startswith("model."):  # (a missing one is named as most of them are)
            self.lead += 1 if name.startswith("model.language_model.") else -1
        if ours in params:
            self.loaded.add(ours)
            return params[ours]
        if (place := expert_slice(ours, params)) is not None:
            fused, target = place
            self.parts.setdefault(fused, set()).add(ours)
            return target
        if not name.endswith(TOLERATED_SUFFIXES):
            self.unknown.append(name)
        return None

    def check_complete(self, params: dict[str, torch.Tensor], config: ModelConfig) -> None:
        """A ModelError naming the first parameter no tensor filled (for a fused expert one, its
        first per-expert tensor not met; named as the files name them), else the first unknown
        tensor: a weight the model would silently go without (a bias, a quantization scale)."""
        missing = []
        for n, param in params.items():
            if n in self.loaded:
                continue
            if n in self.parts:  # stacked from per-expert tensors: name the first one not seen
                projs = ("down_proj",) if n.endswith("down_proj") else ("gate_proj", "up_proj")
                prefix = n.rsplit(".", 1)[0]
                want = [f"{prefix}.{e}.{p}.weight" for e in range(len(param)) for p in projs]
                missing += [w for w in want if w not in self.parts[n]]
            else:
                missing.append(n)
        if missing:
            nested = self.lead > 0 or (self.lead == 0 and self.nested)  # (a tie: the layout's)
            shown = missing[0]
            if nested:
                shown = re.sub(r"^model\.", "model.language_model.", shown)
            raise ModelError(f"checkpoint lacks tensor {shown} ({len(missing)} missing in all)")
        if self.unknown:
            raise ModelError(f"checkpoint has tensor {self.unknown[0]}, which a "
                             f"{config.model_type} model of this config.json does not have "
                             f"({len(self.unknown)} unknown in all)")


def _copy(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    """Copy checkpoint tensor `name` into `target` (converted to its dtype), once it is checked
    to be a float of 16 bits or more and of the target's shape."""
    if not tensor.is_floating_point() or tensor.element_size() < 2:
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise ModelError(f"tensor {name} is stored as {dtype}; statechat loads float32, "
                         "bfloat16 or float16 weights (not quantized ones)")
    if tuple(tensor.shape) != tuple(target.shape):
        raise ModelError(f"tensor {name} has shape {list(tensor.shape)} in the checkpoint but "
                         f"the config implies {list(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


def load_tokenizer(path: Path, chat_template: str | None = None):
    """The tokenizer and chat template stored beside the weights; `chat_template`: a template's
    text that replaces that one (the checkpoint then need not have one)."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), config=transformers_config(path),
                                            local_files_only=True)
    except StrictDataclassError as e:  # transformers checks every field of config.json: the
        # field is named on the error's first line, the reason on the next
        why = " ".join(line.strip() for line in str(e).splitlines())
        raise ModelError(f"{path / 'config.json'} has a value transformers refuses "
                         f"({why})") from None
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a bad checkpoint for the user
        raise ModelError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0]}") from None
    if chat_template is not None:
        tok.chat_template = chat_template
    elif not getattr(tok, "chat_template", None):
        raise ModelError(f"the tokenizer in {path} has no chat template; give one with "
                         "--chat-template")
    return tok


def templated(tokenizer, chat_template: str | None):
    """`tokenizer`, or (a template given that is not its own) a shallow copy of it whose chat
    template is `chat_template` for every render (the tokenizer itself is left as it was: a
    model loaded once may serve engines of other templates)."""
    if chat_template is None or getattr(tokenizer, "chat_template", None) == chat_template:
        return tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = chat_template
    return tokenizer


def load_model(path: str | Path, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu", chat_template: str | None = None) -> LoadedModel:
    """Load the checkpoint directory `path` into `dtype` on `device`; `chat_template`: the
    text of a template that replaces the tokenizer's (load_tokenizer)."""
    path = Path(path).expanduser()
    config = ModelConfig.from_hf(path)
    files = weight_files(path)
    tokenizer = load_tokenizer(path, chat_template)
    device = torch.device(device)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)
    model.model.rotary.reset_parameters()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, files, config)
    model.fuse_projections()
    model.eval()
    return LoadedModel(path, config, model, tokenizer, dtype, device, weights_digest(files))

