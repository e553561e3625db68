"""A real S3-protocol server on 127.0.0.1 (moto's server mode, the one its `moto_server` command runs) for the tests
of shards in an object store, counting the requests it answers; the AWS variables a client needs to reach it.

    with S3Server() as s3:
        s3.env                   {AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL}:
                                 s3fs (fsspec) and the AWS CLI take them from the environment, as on a cluster
        s3.bucket("shards")      a bucket made
        s3.requests              Counter of (method, "bucket/key") of every request ("bucket/" for the bucket)
        s3.refused.add("b/k")    writes of that key (PUT, and a multipart upload's POSTs) answered 403 AccessDenied,
                                 as a bucket policy that denies s3:PutObject on it would (moto's server enforces no
                                 bucket policy without IAM authentication)
"""
from __future__ import annotations

import collections
import threading
import urllib.parse

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

from benchmarks.bench_data import Serving


DENIED = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message>'
          '</Error>')


class QuietHandler(MotoRequestHandler):
    def log_request(self, *args):   # a run reads hundreds of objects
        pass


class S3Server(Serving):
    def __init__(self):
        self.requests, self.lock = collections.Counter(), threading.Lock()
        self.refused: set[str] = set()
        app = DomainDispatcherApplication(create_backend_app)

        def counted(environ, start_response):   # a WSGI layer over moto's app: it only counts
            path = urllib.parse.unquote(environ.get("PATH_INFO", "")).lstrip("/")
            with self.lock:
                self.requests[(environ["REQUEST_METHOD"], path if "/" in path else f"{path}/")] += 1
            if environ["REQUEST_METHOD"] in ("PUT", "POST") and path in self.refused:
                environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))   # the body, as S3 reads it
                body = DENIED.encode()
                start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                                  ("Content-Length", str(len(body)))])
                return [body]
            return app(environ, start_response)

        self.httpd = make_server("127.0.0.1", 0, counted, threaded=True, request_handler=QuietHandler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.env = {"AWS_ACCESS_KEY_ID": "testing-key", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.url}

    def bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="testing-key",
                     aws_secret_access_key="testing-secret").create_bucket(Bucket=name)
        return f"s3://{name}"
