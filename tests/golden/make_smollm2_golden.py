"""Make the golden data for SmolLM2-135M-Instruct Q4_1 from two independent implementations.

    python tests/golden/make_smollm2_golden.py [MODEL_PATH]

Needs, in the Python that runs it (not in Pantheon's own environment): torch (CPU), transformers,
accelerate and gguf for the logits; llama-cpp-python for the llama.cpp greedy continuation. See README,
"Golden data".

Two arithmetics, two references. transformers loads the same GGUF, dequantizes the weights and computes in
f32: exact arithmetic on the stored weights, the reference for Pantheon's float path (PANTHEON_CPU_INT8=0).
llama.cpp rounds every activation row to 8-bit blocks before each matmul of a Q4_1 / Q8_0 weight, which
moves the logits at a few sensitive positions (the token after <|im_end|>) by up to 7% in cosine from the
exact ones: its logits (f32 KV cache) are the reference for Pantheon's int8 path, the default on x86.

Writes tests/golden/smollm2_golden.npz:
  tokens        int32 (T,)   the prompt, tokenized by llama.cpp (special tokens parsed; the model adds no BOS)
  logits_q      int8 (T, V)  transformers' logits at every position, quantized per row:
  logits_scale  float32 (T,) logits ~= logits_q * scale + offset (a step of ~0.1 on a ~25-wide range keeps
  logits_offset float32 (T,) the cosine with the exact row above 0.9999, far finer than the 0.999 bar)
  argmax        int32 (T,)   transformers' exact argmax at each position
  greedy        int32 (32,)  32 tokens greedily decoded by transformers after the prompt
  greedy_llama_cpp int32 (32,) the same continuation from llama.cpp
  llama_logits_q, llama_logits_scale, llama_logits_offset, llama_argmax   llama.cpp's logits, stored the same way
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nI am planning a small vegetable garden on a sunny balcony. Which five vegetables "
    "grow well in containers, how deep should each container be, and how often should I water them during "
    "a hot summer? Please answer with a short list.<|im_end|>\n<|im_start|>assistant\n"
)
N_GREEDY = 32


def llama_cpp_reference(model_path: Path) -> tuple[list[int], np.ndarray, list[int]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=512, verbose=False, n_threads=2, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    tokens = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    greedy = []
    for _ in range(N_GREEDY):
        tok = llm.sample(temp=0.0)
        greedy.append(tok)
        llm.eval([tok])
    return tokens, logits, greedy


def transformers_reference(model_path: Path, tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                 dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([tokens], dtype=torch.long)
        logits = model(ids).logits[0].numpy().astype(np.float32)
        out = model.generate(ids, max_new_tokens=N_GREEDY, do_sample=False, min_new_tokens=N_GREEDY)
    return logits, out[0, len(tokens):].tolist()


def quantize_logits(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 rows with a per-row scale and offset (logits ~= q * scale + offset)."""
    lo, hi = logits.min(axis=1), logits.max(axis=1)
    scale = (hi - lo) / 254.0
    offset = (hi + lo) / 2.0
    q = np.round((logits - offset[:, None]) / scale[:, None]).astype(np.int8)
    return q, scale.astype(np.float32), offset.astype(np.float32)


def main() -> None:
    default = Path(os.environ.get("PANTHEON_HOME", Path.home() / ".cache" / "pantheon"))
    model_path = Path(sys.argv[1]) if len(sys.argv) > 1 else default / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokens, logits_llama, greedy_llama = llama_cpp_reference(model_path)
    assert len(tokens) >= 64, len(tokens)
    logits, greedy = transformers_reference(model_path, tokens)
    q, scale, offset = quantize_logits(logits)
    q_llama, scale_llama, offset_llama = quantize_logits(logits_llama)
    out = Path(__file__).with_name("smollm2_golden.npz")
    np.savez_compressed(out, tokens=np.array(tokens, np.int32), logits_q=q, logits_scale=scale,
                        logits_offset=offset, argmax=logits.argmax(axis=1).astype(np.int32),
                        greedy=np.array(greedy, np.int32), greedy_llama_cpp=np.array(greedy_llama, np.int32),
                        llama_logits_q=q_llama, llama_logits_scale=scale_llama, llama_logits_offset=offset_llama,
                        llama_argmax=logits_llama.argmax(axis=1).astype(np.int32))
    recon = q.astype(np.float32) * scale[:, None] + offset[:, None]
    cos = (recon * logits).sum(1) / np.linalg.norm(recon, axis=1) / np.linalg.norm(logits, axis=1)
    print(f"{out}: {len(tokens)} positions, min reconstruction cosine {cos.min():.6f}")
    print(f"greedy (transformers): {greedy}")
    print(f"greedy (llama.cpp):    {greedy_llama}  same={greedy == greedy_llama}")


if __name__ == "__main__":
    main()
