"""W&B servers on 127.0.0.1 for the real wandb library (online mode), each yielding the environment that points
the library at it:

- `refusing_wandb()`: refuses every request (403), as a self-managed server without the run's permissions, or one
  that lacks a feature a client asks for, answers;
- `accepting_wandb(rewind)`: keeps runs, enough of W&B's API for wandb-core (0.31) to start, resume, rewind and
  finish one: the GraphQL operations it sends (RunResumeStatus, UpsertBucket, RewindRun, CreateRunFiles,
  ServerFeaturesQuery; others answered empty), the history lines of its file stream (kept at their offsets, so a
  resumed or rewound run's lines land after the ones kept), file uploads (dropped). With rewind=False, RewindRun is
  refused with a GraphQL error, as on a server without W&B's rewind preview. It yields (environment, runs): runs by
  id, each {"config": {...}, "history": [rows]}, and runs.requests, the GraphQL operations in order.
"""
import contextlib
import gzip
import http.server
import json
import re
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


class Runs(dict):
    requests: list


def bucket(name: str, project: str, run: dict) -> dict:
    return {"id": f"storage-{name}", "name": name, "displayName": name, "description": None, "sweepName": None,
            "config": json.dumps(run["config"]), "historyLineCount": len(run["history"]),
            "project": {"id": "project", "name": project, "entity": {"id": "entity", "name": "entity"}}}


def keeping(runs: Runs, rewind: bool):
    class Keep(http.server.BaseHTTPRequestHandler):
        def answer(self, body):
            out = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            stream = re.match(r"/files/[^/]+/[^/]+/([^/]+)/file_stream$", self.path)
            if self.path != "/graphql" and not stream:   # uploads, the library's own telemetry
                return self.answer({})
            body = json.loads(gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body)
            if stream:
                run = runs.setdefault(stream.group(1), {"config": {}, "history": []})
                chunk = body.get("files", {}).get("wandb-history.jsonl")
                if chunk:
                    run["history"][chunk["offset"]:] = [json.loads(line) for line in chunk["content"]]
                return self.answer({"exitcode": None, "limits": {}})
            op, v = re.search(r"(?:query|mutation)\s+(\w+)", body["query"]).group(1), body.get("variables") or {}
            runs.requests.append(op)
            entity = {"id": "entity", "name": "entity"}
            if op == "RunResumeStatus":
                run, found = runs.get(v["name"]), None
                if run:
                    found = {**bucket(v["name"], v["project"], run), "wandbConfig": '{"t": 1}', "eventsLineCount": 0,
                             "logLineCount": 0, "eventsTail": "[]", "summaryMetrics": "{}", "tags": [],
                             "historyTail": json.dumps([json.dumps(row) for row in run["history"][-1:]])}
                return self.answer({"data": {"model": {"id": "project", "name": v["project"], "entity": entity,
                                                       "bucket": found}}})
            if op == "UpsertBucket":
                run = runs.setdefault(v["name"], {"config": {}, "history": []})
                run["config"] = json.loads(v["config"]) if v.get("config") else run["config"]
                return self.answer({"data": {"upsertBucket": {"bucket": bucket(v["name"], v["project"], run),
                                                              "inserted": True}}})
            if op == "RewindRun":
                if not rewind:
                    return self.answer({"errors": [{"message": "rewind is not enabled on this server"}],
                                        "data": None})
                run = runs[v["runName"]]
                run["history"] = [row for row in run["history"] if row["_step"] <= v["metricValue"]]
                return self.answer({"data": {"rewindRun": {"rewoundRun": bucket(v["runName"], v["project"], run)}}})
            if op == "CreateRunFiles":
                upload = f"http://127.0.0.1:{self.server.server_port}/upload/"
                return self.answer({"data": {"createRunFiles": {"runID": "storage", "uploadHeaders": [], "files": [
                    {"name": name, "uploadUrl": upload + name} for name in v["files"]]}}})
            if op == "ServerFeaturesQuery":
                return self.answer({"data": {"serverInfo": {"features": []}}})
            return self.answer({"data": {}})

        def do_PUT(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.answer({})

        do_GET = do_PUT

        def log_message(self, *args):
            pass

    return Keep


@contextlib.contextmanager
def accepting_wandb(rewind: bool = True):
    runs = Runs()
    runs.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), keeping(runs, rewind))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"WANDB_BASE_URL": f"http://127.0.0.1:{server.server_port}", "WANDB_API_KEY": "x" * 40,
               "WANDB_SILENT": "true", "WANDB_MODE": "online"}, runs
    finally:
        server.shutdown()
