"""What every command shares: a user's mistake is one `error: …` line and exit status 2, never a traceback.

    UsageError               a bad argument or input file
    one_line_errors(main)    a command's main(argv) -> exit status, wrapped: UsageError, ConfigError (model/fields.py)
                             and DataError (tokendata/remote.py) become one `error: …` line on stderr and status 2

It sits right above the two packages whose errors it knows, model/ and tokendata/, and below everything that has a
command line: pretrain/, evaluation/, tools/ and benchmarks/ all take these from here.
"""
from __future__ import annotations

import functools
import sys

from model.fields import ConfigError
from tokendata.remote import DataError

class UsageError(Exception):
    """A bad argument or input file: printed as one `error: ...` line, exit status 2."""


ONE_LINE = (UsageError, ConfigError, DataError)   # the errors whose message is the whole report


def one_line_errors(main):
    """Wrap a command's main(argv) -> exit status: a known mistake is one `error: …` line and status 2."""
    @functools.wraps(main)
    def wrapped(argv=None) -> int:
        try:
            return main(argv)
        except ONE_LINE as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return wrapped
