"""rlpo_mega.planning.meta_build's child process, forked by tests/warm_launch.py instead of started fresh
(tests/conftest.py, warm_meta_builds): argv[1] is a file holding the request JSON that `meta_build.run` would
write to the child's stdin; what it prints is the child's stdout, unchanged."""
import io
import sys

from rlpo_mega.planning import meta_build

with open(sys.argv[1]) as f:
    sys.stdin = io.StringIO(f.read())
sys.exit(meta_build.main())
