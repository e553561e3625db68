#!/usr/bin/env python
"""Serve a shard directory over HTTP: for ranks on other nodes to stream it (data.shard_dir=http://HOST:PORT), and
for the loader benchmark over a real socket (benchmarks/bench.py --only data).

    python tools/serve_shards.py build/demo/shards --port 8000            # on 127.0.0.1
    python tools/serve_shards.py /data/shards --bind 0.0.0.0 --port 8000  # for the cluster's nodes

A threaded server (Python's http.server) with a deep accept queue: every rank fetches the shards of its first
windows when it starts (data.fetch_threads at a time). It serves whole files (no Range requests: a resumed read
starts over, which the trainer handles).
For a corpus in a bucket, point data.shard_dir at the bucket instead (README: Training on a cluster).
"""
from __future__ import annotations

import argparse
import http.server
import os
import sys
from functools import partial


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512   # every rank's first fetches come at once: none may be turned away

    def handle_error(self, request, client_address):
        """A client that went away mid-transfer (a rank stopped or killed while reading a shard) is no error of the
        server's: one plain line, not a traceback; anything else as socketserver reports it."""
        error = sys.exc_info()[1]
        if isinstance(error, (BrokenPipeError, ConnectionResetError)):
            print(f"serve_shards: {client_address[0]}:{client_address[1]} closed the connection mid-transfer "
                  f"({type(error).__name__})", file=sys.stderr)
            return
        super().handle_error(request, client_address)


class Handler(http.server.SimpleHTTPRequestHandler):
    verbose = False

    def log_message(self, *args):   # one line per request only when asked: a run reads thousands of files
        if self.verbose:
            super().log_message(*args)


def serve(directory: str, bind: str = "127.0.0.1", port: int = 0, handler=Handler) -> Server:
    """A Server for `directory` on (bind, port) (port 0: a free one, in server.server_address), not yet serving."""
    return Server((bind, port), partial(handler, directory=directory))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="a shard directory (tools/make_shards.py --out): manifest.json and the tars")
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--verbose", action="store_true", help="log every request")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.directory, "manifest.json")):
        print(f"error: {args.directory} has no manifest.json: not a shard directory (tools/make_shards.py --out)",
              file=sys.stderr)
        return 2
    Handler.verbose = args.verbose
    server = serve(args.directory, args.bind, args.port)
    host, port = server.server_address[:2]
    print(f"serving {args.directory} at http://{host}:{port} (data.shard_dir=http://{host}:{port}); Ctrl-C stops",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
