"""A stand-in for SGLang (`python engine_standin.py sglang [--mode M] ARGV...`): SGLang cannot run
without CUDA, so its eval flow is tested against this process. It speaks SGLang 0.5.19's
`POST /generate` as that release's code shapes it (tests/fixtures/engines/sglang-0.5.19-generate.json:
a request field or sampling parameter SGLang does not have is refused with 400, the answer carries
only keys SGLang writes), and decodes for real with OUR decoder (dflash.eval.specdec): the target
from `--model-path`, with `--speculative-algorithm DFLASH` the drafter directory it is given (the
SGLang export). So the answers are what our in-process decoder gives; `--mode` bends them:

* `honest`: as decoded;
* `extra-accept`: one more accepted draft at each answer's first step not decided by a near-tie (by the
  gate's constants; a served drafter that accepts differently on the same tokens);
* `coalesce`: streamed two verify steps a chunk, as SGLang does when its client falls behind.

With `--decoder URL` the process loads no model: it speaks the same API and hands each request's
decoding to a resident `DecoderHost` (`serve_decoders`, started once by a test module), which keeps
the models of each argv loaded; so a test that starts many servers pays for torch and the models once.

With `"stream": true` the answer goes out as server-sent events, one chunk per verify step (the
prefill's token first), each carrying the request's output ids and spec counters so far, then
`data: [DONE]` (SGLang 0.5.19's http_server `generate_request` and tokenizer_manager, non-incremental).

vLLM runs for real on CPU: tests/eval/test_engine_vllm.py starts its CPU build."""
import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHAPES = json.loads((REPO / "tests" / "fixtures" / "engines" / "sglang-0.5.19-generate.json").read_text())
sys.path.insert(0, str(REPO))


def parse(argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="honest", choices=("honest", "extra-accept", "coalesce"))
    parser.add_argument("--decoder", help="a DecoderHost's URL: decode there instead of loading the models here")
    parser.add_argument("--model-path")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--speculative-algorithm")
    parser.add_argument("--speculative-draft-model-path")
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=1)
    args, _ = parser.parse_known_args(argv)
    return args


def load_target(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


class Decoder:
    """The target (and drafter) of the argv, decoding a token-id prompt as SGLang would answer it;
    `model`: the target already loaded from --model-path (a DecoderHost's)."""

    def __init__(self, args: argparse.Namespace, model=None):
        from dflash.eval.specdec import NoDrafter, TargetVerifier

        self.args = args
        self.model = model if model is not None else load_target(args.model_path)
        self.drafter = NoDrafter()
        if args.speculative_algorithm == "DFLASH":
            from dflash.eval.dflash_drafter import load_dflash_draft

            # a block of --speculative-num-draft-tokens N: the anchor and N - 1 drafts (eval.draft_tokens)
            self.drafter = load_dflash_draft(args.speculative_draft_model_path, self.model,
                                             draft_tokens=args.speculative_num_draft_tokens - 1)
        layer_ids = getattr(self.drafter, "layer_ids", None)
        self.verifier = TargetVerifier(self.model, layer_ids)

    def chunks(self, input_ids: list, sampling: dict) -> list:
        """The answer as SGLang streams it, one chunk per verify step; the last chunk is the whole answer."""
        from dflash.eval.specdec import DecodeSettings, speculative_decode

        settings = DecodeSettings(block_size=self.args.speculative_num_draft_tokens,
                                  max_new_tokens=int(sampling.get("max_new_tokens", 128)),
                                  temperature=float(sampling.get("temperature", 1.0)),
                                  eos_ids=tuple(sampling.get("stop_token_ids") or ()))
        run = speculative_decode(self.verifier, self.drafter, input_ids, settings)
        accepted = [tau - 1 for tau in run.taus]
        if self.args.mode == "extra-accept":
            accepted = self.bend(accepted, run)
        chunks, committed = [self.chunk(run.tokens[:1], [])], 1
        for step in range(len(accepted)):
            committed += run.taus[step]
            chunks.append(self.chunk(run.tokens[:committed], accepted[: step + 1]))
        chunks[-1] = self.chunk(run.tokens, accepted)
        if self.args.mode == "coalesce":
            chunks = chunks[::2] + ([chunks[-1]] if len(chunks) % 2 == 0 else [])
        return chunks

    def bend(self, accepted: list, run) -> list:
        from dflash.eval.parity import GateConstants, PromptAcceptance

        tie = PromptAcceptance([], draft_margins=run.draft_margins, target_margins=run.target_margins).first_near_tie(
            GateConstants())
        step = 0 if tie is None or tie > 0 else None
        if step is not None and accepted:
            accepted = [count + (index == step) for index, count in enumerate(accepted)]
        return accepted

    def chunk(self, tokens: list, accepted: list) -> dict:
        answer = {"text": " ".join(map(str, tokens)), "output_ids": list(tokens), "meta_info": {}}
        if self.args.speculative_algorithm == "DFLASH" and accepted:
            answer["meta_info"] = self.spec_meta(accepted)
        return answer

    def spec_meta(self, accepted: list) -> dict:
        histogram = [0] * (max(accepted, default=0) + 1)
        for count in accepted:
            histogram[count] += 1
        meta = {"spec_verify_ct": len(accepted), "spec_num_correct_drafts": sum(accepted),
                "spec_correct_drafts_histogram": histogram,
                "spec_num_proposed_drafts": len(accepted) * (self.args.speculative_num_draft_tokens - 1)}
        assert set(meta) <= set(SHAPES["meta_info_spec_keys"]), meta
        return meta


def handler(decoder: Decoder):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, payload, status=200):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._send({})
            self.send_error(404)

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            sampling = request.get("sampling_params") or {}
            unknown = sorted(set(request) - set(SHAPES["request_fields"])) + sorted(set(sampling) - set(SHAPES["sampling_params"]))
            if self.path != "/generate" or unknown or not all(isinstance(t, int) for t in request.get("input_ids") or [None]):
                return self._send({"error": f"bad request: {self.path} {unknown}"}, 400)
            chunks = decoder.chunks(request["input_ids"], sampling)
            assert all(set(chunk) <= set(SHAPES["response_keys"]) for chunk in chunks)
            if not request.get("stream"):
                return self._send(chunks[-1])
            body = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class RemoteDecoder:
    """The Decoder of this argv, kept by the DecoderHost at `args.decoder`: loaded there at start."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.chunks([], {})            # the host loads the models now, as a server does before it is healthy

    def chunks(self, input_ids: list, sampling: dict) -> list:
        import urllib.request

        body = json.dumps({"args": vars(self.args), "input_ids": input_ids, "sampling": sampling}).encode()
        with urllib.request.urlopen(urllib.request.Request(self.args.decoder, data=body), timeout=600) as answer:
            return json.loads(answer.read())


class DecoderHost:
    """Decoders by argv (the server's address left out), each target loaded once: what `--decoder` servers use."""

    def __init__(self):
        self.decoders, self.targets = {}, {}

    def chunks(self, request: dict) -> list:
        args = argparse.Namespace(**request["args"])
        key = json.dumps({k: v for k, v in vars(args).items() if k not in ("host", "port", "decoder")}, sort_keys=True)
        if key not in self.decoders:
            if args.model_path not in self.targets:
                self.targets[args.model_path] = load_target(args.model_path)
            self.decoders[key] = Decoder(args, self.targets[args.model_path])
        return self.decoders[key].chunks(request["input_ids"], request["sampling"]) if request["input_ids"] else []


def serve_decoders(host: str = "127.0.0.1") -> tuple[HTTPServer, str]:
    """A DecoderHost in a thread of this process, one request at a time on one torch thread: (its server, its URL)."""
    import threading

    decoders = DecoderHost()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.dumps(decoders.chunks(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = HTTPServer((host, 0), Handler)

    def serve() -> None:
        import torch

        torch.set_num_threads(1)           # tiny models: extra threads only spin
        server.serve_forever()

    threading.Thread(target=serve, daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}/chunks"


def main() -> None:
    engine, argv = sys.argv[1], sys.argv[2:]
    assert engine == "sglang", "vLLM runs for real on CPU; this stands in for SGLang only"
    print("argv:", json.dumps(argv), flush=True)
    args = parse(argv)
    decoder = RemoteDecoder(args) if args.decoder else Decoder(args)
    ThreadingHTTPServer((args.host, args.port), handler(decoder)).serve_forever()


if __name__ == "__main__":
    main()
