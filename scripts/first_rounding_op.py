"""Which llama.cpp operation first computes a row differently in an n-row pass than alone.

Feeds CONTEXT random tokens, then the next token alone, then the same token at the head of an
N-token block, recording every float32 tensor ggml computes (llama.cpp's eval callback), and
prints the first operation whose output for that token differs, with its sources. This is how
the causes in docs/exactness.md were found; run it after a llama-cpp-python bump.

    python scripts/first_rounding_op.py MODEL.gguf --rows 8 --context 10
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np

F32 = 0  # ggml's GGML_TYPE_F32


class Tensor(ctypes.Structure):
    """The head of ggml's struct ggml_tensor (ggml.h), as far as the name."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


def _describe(pointer: int) -> tuple[str, int, tuple[int, ...]]:
    tensor = ctypes.cast(pointer, ctypes.POINTER(Tensor)).contents
    return tensor.name.decode(), tensor.type, tuple(tensor.ne)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import llama_cpp as api

    recorded: list[tuple[str, list[tuple[str, int, tuple[int, ...]]], np.ndarray]] = []

    def record(pointer: int, ask: bool, _user: object) -> bool:
        tensor = ctypes.cast(pointer, ctypes.POINTER(Tensor)).contents
        if not ask and tensor.type == F32 and tensor.data:
            count = int(np.prod(tensor.ne))
            values = np.ctypeslib.as_array(ctypes.cast(tensor.data, ctypes.POINTER(ctypes.c_float)), shape=(count,))
            sources = [_describe(s) for s in tensor.src if s]
            recorded.append((tensor.name.decode(), sources, values.copy()))
        return True

    callback = api.ggml_backend_sched_eval_callback(record)
    api.llama_backend_init()
    model = api.llama_model_load_from_file(args.model.encode(), api.llama_model_default_params())
    params = api.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = args.context + args.rows + 256, 512, 512
    params.n_threads = params.n_threads_batch = args.threads
    params.cb_eval = callback
    ctx = api.llama_init_from_model(model, params)
    tokens = [int(t) for t in np.random.default_rng(0).integers(100, 30000, size=args.context + args.rows)]

    def decode(ids: list[int], start: int) -> list[tuple[str, list[tuple[str, int, tuple[int, ...]]], np.ndarray]]:
        batch = api.llama_batch_init(len(ids), 0, 1)
        for i, token in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(ids)
        recorded.clear()
        if api.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        api.llama_batch_free(batch)
        return list(recorded)

    decode(tokens[: args.context], 0)
    alone = decode(tokens[args.context : args.context + 1], args.context)
    api.llama_memory_seq_rm(api.llama_get_memory(ctx), 0, args.context, -1)
    block = decode(tokens[args.context :], args.context)
    for (name, sources, one), (_, _, many) in zip(alone, block):
        # The token's own values come first in every tensor whose outer dimension is the token.
        if not np.array_equal(one, many[: len(one)]):
            print(
                f"first difference: {name} (sources {sources}), max {float(np.abs(one - many[: len(one)]).max()):.3g}"
            )
            return
    print(f"no difference in {len(alone)} tensors between 1 row and {args.rows}")


if __name__ == "__main__":
    main()
