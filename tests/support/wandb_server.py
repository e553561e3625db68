"""A W&B server that refuses every request (403), on 127.0.0.1: what a self-managed server without the run's
permissions, or one that lacks a feature a client asks for, answers. `refusing_wandb()` yields the environment that
points the real wandb library at it (online mode)."""
import contextlib
import http.server
import threading


class Refuse(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"errors": [{"message": "permission denied"}]}'
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def refusing_wandb():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"WANDB_BASE_URL": f"http://127.0.0.1:{server.server_port}", "WANDB_API_KEY": "x" * 40,
               "WANDB_SILENT": "true", "WANDB_MODE": "online"}
    finally:
        server.shutdown()
