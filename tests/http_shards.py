"""A real HTTP server on 127.0.0.1 that serves a shard directory, and can be told to misbehave the way object stores
and proxies do: drop the connection half-way through a file, answer 5xx, or not have a file at all."""
from __future__ import annotations

import collections
import os
import socket
import threading

from tools.serve_shards import Handler, serve


class FaultyHandler(Handler):
    """tools/serve_shards.py's handler (no Range support: a resumed read starts over, which the client must handle),
    with the server's fault plan applied to GET requests."""

    def do_GET(self):
        srv, name = self.server, os.path.basename(self.path)
        with srv.lock:
            srv.gets[name] += 1
            plan = srv.faults.get(name)
            fault = plan.pop(0) if plan else None
        if name in srv.missing:
            return self.send_error(404)
        if fault == "503":
            return self.send_error(503)
        if fault == "drop":
            with open(self.translate_path(self.path), "rb") as f:
                data = f.read()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])   # half the file, then the connection goes
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return None
        return super().do_GET()

    def do_HEAD(self):
        with self.server.lock:
            self.server.heads[os.path.basename(self.path)] += 1
        if os.path.basename(self.path) in self.server.missing:
            return self.send_error(404)
        return super().do_HEAD()


class ShardServer:
    """`with ShardServer(root) as srv:` serves root at srv.url (http://127.0.0.1:PORT). srv.faults[name] = ["drop",
    "503", …]: the next GETs of that file fail that way, one each; srv.missing holds names answered with 404;
    srv.gets and srv.heads count the GETs and HEADs of each name."""

    def __init__(self, root: str):
        self.httpd = serve(root, handler=FaultyHandler)
        self.httpd.lock, self.httpd.faults, self.httpd.missing = threading.Lock(), {}, set()
        self.httpd.gets, self.httpd.heads = collections.Counter(), collections.Counter()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    faults = property(lambda self: self.httpd.faults)
    missing = property(lambda self: self.httpd.missing)
    gets = property(lambda self: self.httpd.gets)
    heads = property(lambda self: self.httpd.heads)

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
