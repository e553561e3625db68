"""A real HTTP(S) server on 127.0.0.1 that serves a shard directory, and can be told to misbehave the way object stores
and proxies do: drop the connection half-way through a file, answer 5xx, or not have a file at all; to honour Range
requests (as object stores do) or not (tools/serve_shards.py); to speak TLS with a given certificate; to want a bearer
token. It takes PUTs too (files written into the directory, as an object store's upload)."""
from __future__ import annotations

import collections
import os
import re
import socket
import ssl
import sys
import threading
from functools import partial

from benchmarks.bench_data import Serving
from tools.serve_shards import Handler, Server


class FaultyHandler(Handler):
    """tools/serve_shards.py's handler with the server's plan applied: its fault plan to GET requests, Range requests
    honoured in Range mode (206 from byte k on; without it every GET sends the whole file, so a resumed read starts
    over), a bearer token required where the server has one."""

    def authorized(self) -> bool:
        srv = self.server
        if srv.token is None or self.headers.get("Authorization") == f"Bearer {srv.token}":
            return True
        with srv.lock:
            srv.refused += 1
        self.send_error(401)
        return False

    def do_GET(self):
        srv, name = self.server, os.path.basename(self.path)
        if not self.authorized():
            return None
        with srv.lock:
            srv.gets[name] += 1
            srv.ranges[name].append(self.headers.get("Range"))
            plan = srv.faults.get(name)
            fault = plan.pop(0) if plan else None
        if name in srv.missing:
            return self.send_error(404)
        if fault == "503":
            return self.send_error(503)
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            return super().do_GET()   # its 404 "File not found"
        with open(path, "rb") as f:
            data = f.read()
        start = 0
        wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if srv.range_mode and wanted and int(wanted[1]) < len(data):
            start = int(wanted[1])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if fault == "drop":
            body = body[: len(body) // 2]   # half of what was asked for, then the connection goes
        self.wfile.write(body)
        self.wfile.flush()
        with srv.lock:
            srv.served[name] += len(body)
        if fault == "drop":
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
        return None

    def do_PUT(self):
        """A file written whole into the served directory (an object store's upload), with the token if one is set."""
        if not self.authorized():
            return None
        name = os.path.basename(self.path)
        data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(os.path.join(self.directory, name), "wb") as f:
            f.write(data)
        with self.server.lock:
            self.server.puts[name] += 1
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return None

    def do_HEAD(self):
        if not self.authorized():
            return None
        with self.server.lock:
            self.server.heads[os.path.basename(self.path)] += 1
        if os.path.basename(self.path) in self.server.missing:
            return self.send_error(404)
        return super().do_HEAD()


class PlannedServer(Server):
    """Server with the plan's state; with `tls` (a server-side ssl.SSLContext) each accepted connection is counted
    and its TLS handshake done before it is served (a client that rejects the certificate ends there)."""
    tls: ssl.SSLContext | None = None

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):   # a client killed mid-read
            super().handle_error(request, client_address)

    def get_request(self):
        sock, address = super().get_request()
        with self.lock:
            self.connections += 1
        if self.tls is None:
            return sock, address
        try:
            return self.tls.wrap_socket(sock, server_side=True), address
        except OSError:
            sock.close()
            raise


class ShardServer(Serving):
    """`with ShardServer(root) as srv:` serves root at srv.url (http://127.0.0.1:PORT, or https:// with `tls`).
    srv.faults[name] = ["drop", "503", …]: the next GETs of that file fail that way, one each; srv.missing holds
    names answered with 404; srv.gets, srv.heads and srv.puts count the GETs, HEADs and PUTs (a file written into
    root) of each name, srv.ranges[name] lists the
    Range header of each GET (None: none), srv.served[name] the bytes of it sent; srv.connections counts the TCP
    connections accepted, srv.refused the requests turned away for want of the token.
    `ranges`: honour Range requests; `tls`: a server-side ssl.SSLContext holding the certificate; `token`: every
    request must carry `Authorization: Bearer <token>` (else 401)."""

    def __init__(self, root: str, ranges: bool = False, tls: ssl.SSLContext | None = None, token: str | None = None):
        self.httpd = h = PlannedServer(("127.0.0.1", 0), partial(FaultyHandler, directory=root))
        h.lock, h.faults, h.missing, h.range_mode, h.tls, h.token = threading.Lock(), {}, set(), ranges, tls, token
        h.gets, h.heads, h.served = collections.Counter(), collections.Counter(), collections.Counter()
        h.puts = collections.Counter()
        h.ranges, h.connections, h.refused = collections.defaultdict(list), 0, 0
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{h.server_address[1]}"

    def __getattr__(self, name):   # the plan and the counts live on the server, which the handlers see
        return getattr(self.httpd, name)
