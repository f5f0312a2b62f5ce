"""A stand-in for SGLang (`python engine_standin.py sglang ARGV...`): SGLang cannot run without CUDA,
so its eval flow is tested against this process, which parses the engine argv it is given, answers
the engine's HTTP API (health, OpenAI chat completions, SGLang's /server_info; vLLM's /metrics is
kept for its argv only) and reports a fixed acceptance per speculative method. vLLM runs for real
on CPU: tests/eval/test_engine_vllm.py starts its CPU build.
Stand-in figures: DFLASH tau 3.5, NGRAM / ngram tau 1.5."""
import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TAU = {"DFLASH": 3.5, "NGRAM": 1.5, "dflash": 3.5, "ngram": 1.5}


def parse(engine: str, argv: list) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--speculative-algorithm")
    parser.add_argument("--speculative-config")
    args, _ = parser.parse_known_args(argv)
    args.method = args.speculative_algorithm or (json.loads(args.speculative_config)["method"]
                                                 if args.speculative_config else None)
    return args


def handler(engine: str, method: str):
    state = {"requests": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, payload, content_type="application/json"):
            body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._send({})
            if self.path == "/server_info" and engine == "sglang":
                states = {"avg_spec_accept_length": TAU[method]} if method else {}
                return self._send({"internal_states": [states]})
            if self.path == "/metrics" and engine == "vllm":
                drafts = 10 * state["requests"] if method else 0
                accepted = (TAU[method] - 1) * drafts if method else 0
                text = (f"vllm:spec_decode_num_drafts_total{{engine=\"0\"}} {drafts}\n"
                        f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\"}} {accepted}\n")
                return self._send(text.encode(), "text/plain")
            self.send_error(404)

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/chat/completions" and request["messages"]
            state["requests"] += 1
            words = request["messages"][-1]["content"].split()[: request["max_tokens"]]
            self._send({"choices": [{"message": {"role": "assistant", "content": " ".join(words)}}],
                        "usage": {"completion_tokens": len(words)}})

    return Handler


def main() -> None:
    engine, argv = sys.argv[1], sys.argv[2:]
    print("argv:", json.dumps(argv), flush=True)
    args = parse(engine, argv)
    ThreadingHTTPServer((args.host, args.port), handler(engine, args.method)).serve_forever()


if __name__ == "__main__":
    main()
