"""The flags of every command that reads or writes shards at a URL: the trust and credentials that training takes
from data.ca_bundle, data.http_headers_from_env and data.headers_over_http (tokendata/remote.py `configure`).

    add_remote_arguments(parser)     --ca-bundle PEM, --header-from-env HEADER=VARIABLE (repeatable),
                                     --headers-over-http
    configure_remote(args, data)     remote.configure from the flags, over `data`: the data section of the run's
                                     training config (a checkpoint's, a release's), whose settings apply by default
"""
from __future__ import annotations

from cli import UsageError
from tokendata import remote


def add_remote_arguments(p) -> None:
    g = p.add_argument_group("shards at a URL (as data.ca_bundle, data.http_headers_from_env in training)")
    g.add_argument("--ca-bundle", metavar="PEM", default=None,
                   help="CA certificates an https:// shard server is verified against (default: the run's "
                        "data.ca_bundle, else the system's)")
    g.add_argument("--header-from-env", metavar="HEADER=VARIABLE", action="append", default=None,
                   help="send HEADER with every http(s):// request, its value from the environment variable "
                        "VARIABLE (e.g. Authorization=SHARDS_TOKEN); default: the run's data.http_headers_from_env")
    g.add_argument("--headers-over-http", action="store_true", default=None,
                   help="send those headers to plain http:// URLs too (refused by default: they go unencrypted)")


def configure_remote(args, data: dict | None = None) -> None:
    """Every HTTP(S) request of this process as the flags say, else as the run's data section `data` says."""
    data = data or {}
    headers = dict(data.get("http_headers_from_env") or {})
    if args.header_from_env:
        headers = {}
        for item in args.header_from_env:
            header, _, variable = item.partition("=")
            if not header or not variable.isidentifier():
                raise UsageError(f"--header-from-env {item}: give HEADER=VARIABLE, e.g. Authorization=SHARDS_TOKEN")
            headers[header] = variable
    over_http = args.headers_over_http if args.headers_over_http is not None else data.get("headers_over_http", False)
    remote.configure(args.ca_bundle or data.get("ca_bundle"), headers, bool(over_http))
