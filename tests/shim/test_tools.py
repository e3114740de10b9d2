"""Everyday tools under `tierstore run` on the stand-in store: the same bytes, output and exit code as the
same command run directly on the store, on a cold and a warm cache, and what a warm trusted cache
(`revalidate = never`) still sends the store, read from the stand-in's own counters.

Every tool runs four times under `tierstore run`: cold then warm with `revalidate = always` on one tier,
cold then warm with `revalidate = never` on a second (with every file of the tree read once more before
the last pass, so that the cache holds what a walker only listed). A warm pass reads no byte from the
store, except where a tool exits before a large file's copy is finished (`partial`): that file is copied
again, never more than once. On the last pass a tool sends the store nothing at all, walkers included
(find, cp -r, tar, copytree, opendir: directory listings are recorded once and replayed) and tools that
copy extended attributes and ACLs (cp -a, copytree: each path's answers are recorded once and replayed),
except the path lookup of a directory a tool `chdir`s into (rsync: see `chdirs`); each case prints what it
sent (`pytest -s`). Some paths of the store carry extended attributes, which the stand-in store serves
(and counts), so a tool that copies them must copy the store's, not a tier copy's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.data import content
from tests.helpers.marks import needs
from tests.helpers.stores import mounted_store, store_stats

# The tree under the store's `data/` directory: nested directories, files below and above inline_max
# (1 MiB here, so that the large ones take the shim's read-while-copying path on a miss), an empty file,
# and a relative symlink to a file of the source.
INLINE_MAX = 1 << 20
FILES = {
    "small.txt": 100,
    "empty.bin": 0,
    "large.bin": 3 * INLINE_MAX + 12345,
    "a/mid.bin": 200_000,
    "a/b/c/deep.bin": 5000,
    "a/b/large2.bin": INLINE_MAX + 1,
    "d/e.txt": 7,
}
SYMLINK = ("a/b/link.bin", "../mid.bin")
REGULAR = sorted(FILES)
# Extended attributes of paths of the store: a file's, a directory's (longer than the first buffer
# Python's os.getxattr tries, so it meets ERANGE) and an empty value.
XATTRS = {
    "small.txt": {"user.origin": b"store"},
    "a": {"user.note": b"n" * 300},
    "a/b/c/deep.bin": {"user.empty": b""},
}

# realpath, lstat, stat, statx, fstatat and fstat (after open, and after reading) of each path; readlink;
# and whether what describes the open descriptor matches what describes the path. `dir` mode lists each
# directory with opendir/readdir and fstatat of every entry. Device and inode numbers are compared within
# a run, never printed: the stand-in's numbers are its own.
PROBE_C = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

static void diff(const char *what, const struct stat *a, const struct stat *b) {
    printf(" %s=", what);
    if (a->st_dev != b->st_dev) printf("dev,");
    if (a->st_ino != b->st_ino) printf("ino,");
    if (a->st_mode != b->st_mode) printf("mode,");
    if (a->st_nlink != b->st_nlink) printf("nlink,");
    if (a->st_uid != b->st_uid || a->st_gid != b->st_gid) printf("owner,");
    if (a->st_size != b->st_size) printf("size,");
    if (a->st_mtim.tv_sec != b->st_mtim.tv_sec || a->st_mtim.tv_nsec != b->st_mtim.tv_nsec) printf("mtime,");
    if (a->st_ctim.tv_sec != b->st_ctim.tv_sec || a->st_ctim.tv_nsec != b->st_ctim.tv_nsec) printf("ctime,");
    printf("ok");
}

static void from_statx(const struct statx *x, struct stat *st) {
    memset(st, 0, sizeof *st);
    st->st_dev = makedev(x->stx_dev_major, x->stx_dev_minor);
    st->st_ino = x->stx_ino; st->st_mode = x->stx_mode; st->st_nlink = x->stx_nlink;
    st->st_uid = x->stx_uid; st->st_gid = x->stx_gid; st->st_size = x->stx_size;
    st->st_mtim.tv_sec = x->stx_mtime.tv_sec; st->st_mtim.tv_nsec = x->stx_mtime.tv_nsec;
    st->st_ctim.tv_sec = x->stx_ctime.tv_sec; st->st_ctim.tv_nsec = x->stx_ctime.tv_nsec;
}

static int probe_file(const char *p) {
    struct stat l, s, at, xs, f0, f1;
    struct statx x;
    char rp[PATH_MAX], link[PATH_MAX];
    printf("%s", p);
    if (!realpath(p, rp)) { printf(" realpath:errno=%d\n", errno); return 1; }
    printf(" realpath=%s", rp);
    if (lstat(p, &l) != 0) { printf(" lstat:errno=%d\n", errno); return 1; }
    printf(" lstat=%o,%lld,%lld.%09ld", l.st_mode, (long long)l.st_size, (long long)l.st_mtim.tv_sec, l.st_mtim.tv_nsec);
    ssize_t n = readlink(p, link, sizeof link - 1);
    if (n >= 0) { link[n] = 0; printf(" readlink=%s", link); } else printf(" readlink:errno=%d", errno);
    if (stat(p, &s) != 0) { printf(" stat:errno=%d\n", errno); return 1; }
    printf(" stat=%o,%lld,%lld.%09ld", s.st_mode, (long long)s.st_size, (long long)s.st_mtim.tv_sec, s.st_mtim.tv_nsec);
    if (fstatat(AT_FDCWD, p, &at, AT_SYMLINK_NOFOLLOW) != 0) { printf(" fstatat:errno=%d\n", errno); return 1; }
    diff("fstatat_nofollow_vs_lstat", &at, &l);
    if (statx(AT_FDCWD, p, 0, STATX_BASIC_STATS, &x) != 0) { printf(" statx:errno=%d\n", errno); return 1; }
    from_statx(&x, &xs);
    diff("statx_vs_stat", &xs, &s);
    int fd = open(p, O_RDONLY);
    if (fd < 0) { printf(" open:errno=%d\n", errno); return 1; }
    if (fstat(fd, &f0) != 0) { printf(" fstat:errno=%d\n", errno); return 1; }
    diff("fstat_vs_stat", &f0, &s);
    char buf[65536];
    unsigned long h = 1469598103934665603UL;
    long total = 0, r;
    while ((r = read(fd, buf, sizeof buf)) > 0) { for (long i = 0; i < r; i++) h = (h ^ (unsigned char)buf[i]) * 1099511628211UL; total += r; }
    if (fstat(fd, &f1) != 0) { printf(" fstat:errno=%d\n", errno); return 1; }
    diff("fstat_after_read_vs_stat", &f1, &s);
    struct statx fx;
    struct stat fxs;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_BASIC_STATS, &fx) != 0) { printf(" statx_fd:errno=%d\n", errno); return 1; }
    from_statx(&fx, &fxs);
    diff("statx_fd_vs_stat", &fxs, &s);
    close(fd);
    printf(" read=%ld fnv=%lx\n", total, h);
    return 0;
}

/* Each answer of the attribute calls as the program sees it: the size or errno, and the bytes. */
static void show(const char *what, ssize_t n, const char *buf) {
    if (n < 0) { printf(" %s:errno=%d", what, errno); return; }
    printf(" %s=%zd", what, n);
    if (buf) { putchar(':'); for (ssize_t i = 0; i < n; i++) putchar(buf[i] ? buf[i] : '|'); }
}

/* listxattr and getxattr of every name, by path (following a symlink and not) and by descriptor, with a
   size query, a buffer too small and a whole one; a missing name and the ACL. */
static int probe_xattr(const char *p) {
    char list[4096], buf[4096], one[1];
    printf("%s", p);
    show("list_size", listxattr(p, NULL, 0), NULL);
    show("list_short", listxattr(p, one, 1), NULL);
    ssize_t n = listxattr(p, list, sizeof list);
    show("list", n, list);
    show("llist", llistxattr(p, buf, sizeof buf), buf);
    for (ssize_t at = 0; n > 0 && at < n; at += strlen(list + at) + 1) {
        const char *name = list + at;
        printf(" [%s]", name);
        show("size", getxattr(p, name, NULL, 0), NULL);
        show("short", getxattr(p, name, one, 1), NULL);
        show("get", getxattr(p, name, buf, sizeof buf), buf);
        show("lget", lgetxattr(p, name, buf, sizeof buf), buf);
    }
    show("missing", getxattr(p, "user.missing", buf, sizeof buf), NULL);
    show("lmissing", lgetxattr(p, "user.missing", buf, sizeof buf), NULL);
    show("acl", getxattr(p, "system.posix_acl_access", buf, sizeof buf), NULL);
    show("acl_default", getxattr(p, "system.posix_acl_default", buf, sizeof buf), NULL);
    int fd = open(p, O_RDONLY);
    if (fd < 0) { printf(" open:errno=%d\n", errno); return 1; }
    show("flist_size", flistxattr(fd, NULL, 0), NULL);
    show("flist", flistxattr(fd, buf, sizeof buf), buf);
    for (ssize_t at = 0; n > 0 && at < n; at += strlen(list + at) + 1) {
        show("fshort", fgetxattr(fd, list + at, one, 1), NULL);
        show("fget", fgetxattr(fd, list + at, buf, sizeof buf), buf);
    }
    show("fmissing", fgetxattr(fd, "user.missing", buf, sizeof buf), NULL);
    show("facl", fgetxattr(fd, "system.posix_acl_access", buf, sizeof buf), NULL);
    close(fd);
    printf("\n");
    return 0;
}

static int cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int probe_dir(const char *p) {
    DIR *d = opendir(p);
    if (!d) { printf("%s opendir:errno=%d\n", p, errno); return 1; }
    char *names[4096];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 4096) {
        struct stat st;
        char line[PATH_MAX + 128];
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            snprintf(line, sizeof line, "%s type=%d fstatat:errno=%d", e->d_name, e->d_type, errno);
        } else {
            snprintf(line, sizeof line, "%s type=%d mode=%o size=%lld", e->d_name, e->d_type, st.st_mode,
                     S_ISDIR(st.st_mode) ? 0LL : (long long)st.st_size);
        }
        names[n++] = strdup(line);
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp);
    printf("%s:", p);
    for (int i = 0; i < n; i++) printf(" [%s]", names[i]);
    printf("\n");
    return 0;
}

int main(int argc, char **argv) {
    int rc = 0;
    for (int i = 2; i < argc; i++)
        rc |= strcmp(argv[1], "dir") == 0     ? probe_dir(argv[i])
              : strcmp(argv[1], "xattr") == 0 ? probe_xattr(argv[i])
                                              : probe_file(argv[i]);
    return rc;
}
"""

COPYTREE = textwrap.dedent(
    """
    import shutil, sys
    shutil.copytree(sys.argv[1], sys.argv[2])                     # follows the symlink: copies its target
    shutil.copytree(sys.argv[1], sys.argv[2] + "-links", symlinks=True)
    """
)


@dataclass
class Store:
    backing: Path
    mount: Path
    data: Path  # the tree, on the mount
    out: Path  # where tools write: outside the source
    probe: Path  # the compiled C program
    scratch: Path


@pytest.fixture(scope="module")
@needs("fuse")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    tmp = tmp_path_factory.mktemp("tools")
    probe = tmp / "probe"
    (tmp / "probe.c").write_text(PROBE_C)
    cc = subprocess.run(
        ["cc", "-O1", "-Wall", "-o", str(probe), str(tmp / "probe.c")], capture_output=True, text=True
    )
    assert cc.returncode == 0, cc.stderr
    (tmp / "copytree.py").write_text(COPYTREE)
    # Each read request waits 2 ms, so that copying a large file outlasts a tool that reads its head.
    with mounted_store(tmp, data_latency="2ms") as (backing, mount):
        for i, (rel, size) in enumerate(sorted(FILES.items())):
            p = backing / "data" / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content(i, size))
        (backing / "data" / SYMLINK[0]).symlink_to(SYMLINK[1])
        for rel, attrs in XATTRS.items():
            for name, value in attrs.items():
                os.setxattr(backing / "data" / rel, name, value)
        yield Store(backing, mount, mount / "data", tmp / "out", probe, tmp)


@dataclass(frozen=True)
class Tool:
    """A command (with `{data}`, `{out}`, `{probe}`, `{py}`, `{scratch}` filled in) and how to judge it."""

    argv: tuple[str, ...]
    # How many times the tool `chdir`s into a directory of the source. The kernel looks the directory up
    # on the store to enter it (on the stand-in: a lookup and a permission check, two `getattr`), and the
    # shim cannot enter it on the tool's behalf without the same lookup: a stand-in directory of the tier
    # as the working directory would be seen empty by every call the shim does not interpose and by
    # children it does not reach (static binaries, setuid programs, glibc's posix_spawn of system()).
    chdirs: int = 0
    keep_mtimes: bool = False  # the tool preserves times: compare them in what it wrote
    # Reads part of a file larger than inline_max and exits while the shim's background copy of it is
    # still running: a process that exits before a large file's copy is finished leaves no copy (it is
    # never published partial), so the next reader copies it again. Its warm passes may read the store
    # again, never more than the file's size; once the file is cached whole, nothing.
    partial: int = 0  # the size of that file


def d(*rel: str) -> tuple[str, ...]:
    return tuple(f"{{data}}/{r}" for r in rel)


TOOLS = {
    "cat": Tool(("cat", *d(*REGULAR, SYMLINK[0]))),
    "md5sum": Tool(("md5sum", *d(*REGULAR))),
    "dd": Tool(
        ("dd", "if={data}/large.bin", "bs=64k", "skip=3", "count=20", "status=none"),
        partial=FILES["large.bin"],
    ),
    "head-c": Tool(("head", "-c", "4096", *d("large.bin")), partial=FILES["large.bin"]),
    "dd-whole-small": Tool(("dd", "if={data}/a/mid.bin", "of={out}", "bs=4096", "status=none")),
    "tail-c": Tool(("tail", "-c", "100000", *d("large.bin", "a/b/large2.bin", "small.txt", "empty.bin"))),
    "tail-c-from": Tool(("tail", "-c", "+1000", *d("a/mid.bin"))),
    "cp-files": Tool(("sh", "-c", 'mkdir {out} && cp "$@" {out}/', "cp", *d(*REGULAR))),
    "cp-preserve": Tool(
        ("sh", "-c", 'mkdir {out} && cp -p "$@" {out}/', "cp", *d(*REGULAR)), keep_mtimes=True
    ),
    "cp-symlink-deref": Tool(("cp", "-L", *d(SYMLINK[0]), "{out}")),
    "c-probe-files": Tool(("{probe}", "file", *d(*REGULAR))),
    "c-probe-symlink": Tool(("{probe}", "file", *d(SYMLINK[0]))),
    "c-probe-opendir": Tool(("{probe}", "dir", *d(".", "a", "a/b", "a/b/c", "d"))),
    "c-probe-xattr": Tool(("{probe}", "xattr", *d(*REGULAR, SYMLINK[0], ".", "a", "a/b/c"))),
    "cp-r": Tool(("cp", "-r", "{data}", "{out}")),
    "cp-a": Tool(("cp", "-a", "{data}", "{out}"), keep_mtimes=True),
    "tar-c": Tool(("tar", "c", "--format=gnu", "--sort=name", "-f", "{out}", "-C", "{data}/..", "data")),
    "tar-c-stdout": Tool(("tar", "cv", "--format=gnu", "--sort=name", "-f", "-", "-C", "{data}", ".")),
    "rsync-a": Tool(
        ("rsync", "-a", "-i", "{data}/", "{out}/"),
        keep_mtimes=True,
        chdirs=1,  # its sender enters the source directory to walk it
    ),
    "find": Tool(
        ("find", "{data}", "-printf", "%P %y %Y %s %m %T@ %l\\n"),
    ),
    "find-type-f-size": Tool(("find", "{data}", "-type", "f", "-size", "+10k", "-newer", "{data}/empty.bin")),
    "find-exec-md5sum": Tool(("find", "{data}", "-type", "f", "-exec", "md5sum", "{{}}", "+")),
    "shutil-copytree": Tool(("{py}", "{scratch}/copytree.py", "{data}", "{out}"), keep_mtimes=True),
}


def manifest(root: Path, keep_mtimes: bool) -> list[tuple]:
    """What a tool wrote: every path under `root` with its kind, mode, size, digest or link target, and
    its extended attributes."""
    if not root.exists() and not Path(f"{root}-links").exists():
        return []
    out = []
    for top in (root, Path(f"{root}-links")):
        if not top.exists():
            continue
        paths = [top, *sorted(top.rglob("*"))] if top.is_dir() else [top]
        for p in paths:
            st = p.lstat()
            rel = str(p.relative_to(top.parent))
            names = sorted(os.listxattr(p, follow_symlinks=False))
            out.append((rel, "xattrs", [(n, os.getxattr(p, n, follow_symlinks=False)) for n in names]))
            if stat.S_ISLNK(st.st_mode):
                out.append((rel, "link", os.readlink(p)))
            elif stat.S_ISDIR(st.st_mode):
                out.append((rel, "dir", oct(st.st_mode)))
            else:
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
                out.append(
                    (
                        rel,
                        "file",
                        oct(st.st_mode),
                        st.st_size,
                        digest,
                        *([st.st_mtime_ns] if keep_mtimes else []),
                    )
                )
    return out


@dataclass
class Result:
    rc: int
    stdout: bytes
    stderr: bytes
    wrote: list[tuple]

    def shown(self) -> str:
        return f"exit {self.rc}, stderr {self.stderr.decode(errors='replace')[-1500:]!r}"


def run_tool(store: Store, tool: Tool, tier: str | None, revalidate: str = "always") -> Result:
    """Runs the tool directly on the store (no tier) or under `tierstore run`; what it wrote goes to a fresh
    `out`, the same path every run, so that outputs naming it compare equal."""
    shutil.rmtree(store.out, ignore_errors=True)
    if store.out.exists() or Path(f"{store.out}-links").exists():
        store.out.unlink(missing_ok=True)
    shutil.rmtree(f"{store.out}-links", ignore_errors=True)
    names = {
        "data": store.data,
        "out": store.out,
        "probe": store.probe,
        "py": sys.executable,
        "scratch": store.scratch,
    }
    argv = [a.format(**{k: str(v) for k, v in names.items()}) for a in tool.argv]
    env = {**os.environ, "TIERSTORE_INLINE_MAX": str(INLINE_MAX), "LC_ALL": "C"}
    if tier is not None:
        argv = [sys.executable, "-m", "tierstore.cli", "--source", str(store.mount), "--tier", f"{tier}:64M",
                "run", "--revalidate", revalidate, "--", *argv]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, env=env, timeout=60, cwd=store.scratch)
    return Result(r.returncode, r.stdout, r.stderr, manifest(store.out, tool.keep_mtimes))


def sent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The store's operations between two readings of its counters, per kind (totals left out)."""
    totals = {"metadata_ops", "data_ops"}
    return {
        k: after[k] - before.get(k, 0)
        for k in sorted(after)
        if k not in totals and after[k] != before.get(k, 0)
    }


# Tools whose calls another tool above already makes (its reads, walks, partial reads and copies of
# attributes): `slow`, so that `make test-fast` runs one tool of each kind.
SLOW_TOOLS = {
    "md5sum",  # cat
    "head-c",  # dd: a head of a large file
    "dd-whole-small",  # cat
    "tail-c-from",  # tail-c
    "cp-files",  # cp-a
    "cp-preserve",  # cp-a
    "cp-symlink-deref",  # cat, c-probe-symlink
    "cp-r",  # cp-a
    "tar-c-stdout",  # tar-c
    "find-type-f-size",  # find
    "find-exec-md5sum",  # find, cat
    "c-probe-symlink",  # c-probe-files, test_symlink_answered_from_its_record_and_forgotten_on_change
    "tar-c",  # cp-a, rsync-a: walkers
    "find",  # cp-a, rsync-a, c-probe-opendir: listings
    "shutil-copytree",  # cp-a: a walker that copies attributes
}
assert not SLOW_TOOLS - set(TOOLS), f"no such tool: {SLOW_TOOLS - set(TOOLS)}"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TOOLS else n for n in TOOLS]
)
def test_tool_under_tierstore_run(store: Store, tier: str, name: str) -> None:
    """The same bytes, output, attributes and exit code as a direct run, cold and warm; a warm trusted
    cache sends the store nothing (but the lookups of the directories a tool `chdir`s into)."""
    tool = TOOLS[name]
    if shutil.which(tool.argv[0]) is None and not tool.argv[0].startswith("{"):
        pytest.fail(f"{tool.argv[0]} is not installed: `make setup` installs it")
    direct = run_tool(store, tool, None)
    assert direct.rc == 0, f"the command fails even without tierstore: {direct.shown()}"
    passes = [
        ("cold, revalidate=always", f"{tier}-always", "always"),
        ("warm, revalidate=always", f"{tier}-always", "always"),
        ("cold, revalidate=never", f"{tier}-never", "never"),
        ("warm, revalidate=never", f"{tier}-never", "never"),
    ]
    for label, tier_dir, revalidate in passes:
        if label == passes[-1][0]:
            # A warm cache holds every file, whether the tool read it or only listed it.
            fill = run_tool(store, TOOLS["cat"], tier_dir, revalidate)
            assert fill.rc == 0, fill.shown()
        before = store_stats(store.mount)
        got = run_tool(store, tool, tier_dir, revalidate)
        ops = sent(before, store_stats(store.mount))
        print(f"\n{name}, {label}: store operations {json.dumps(ops)}")
        assert (got.rc, got.stderr) == (direct.rc, direct.stderr), (
            f"{label}: {got.shown()}; direct: {direct.shown()}"
        )
        assert got.stdout == direct.stdout, f"{label}: output differs from a direct run"
        assert got.wrote == direct.wrote, f"{label}: what the tool wrote differs from a direct run"
        if label.startswith("warm") and tool.partial and label != passes[-1][0]:
            # The first pass exited before the copy was finished: the file is copied again, once.
            assert ops.get("bytes_read", 0) <= tool.partial, (
                f"{label}: more than the file was read from the store: {ops}"
            )
        elif label.startswith("warm"):
            # The tool's own first pass left every file it read in the cache, whole.
            assert ops.get("bytes_read", 0) == 0, (
                f"{label}: a file the first pass read came from the store again"
            )
    print(f"\n{name}: store operations on the warm pass with revalidate=never: {json.dumps(ops)}")
    if not tool.chdirs:
        assert ops == {}, f"a warm trusted cache sent the store: {ops}"
    else:
        # Nothing but the kernel's lookup of each directory entered (see `chdirs`), whatever the tree.
        assert set(ops) == {"getattr"} and ops["getattr"] <= 2 * tool.chdirs, (
            f"a warm trusted cache sent the store more than the lookups of chdir: {ops}"
        )


# What a trusted cache records besides files: a symlink met by `lstat` (its `lstat`, its target and where
# it resolves to) and the source's `statfs`. Each is asked of the store once, then answered from the index.

LINK_PROBE = textwrap.dedent(
    """
    import json, os, sys
    link = sys.argv[1]
    st, lst = os.stat(link), os.lstat(link)
    with open(link, "rb") as f:
        size = len(f.read())
    print(json.dumps([os.readlink(link), os.path.realpath(link), lst.st_mode, lst.st_size, st.st_mode,
                      st.st_size, st.st_ino, size, os.path.isdir(link)]))
    """
)

STATFS_PROBE = textwrap.dedent(
    """
    import json, os, sys
    keep = ("f_bsize", "f_frsize", "f_blocks", "f_files", "f_fsid", "f_flag", "f_namemax")
    out = []
    for p in sys.argv[1:]:
        out.append([getattr(os.statvfs(p), k) for k in keep])
        if os.path.isfile(p):
            with open(p, "rb") as f:
                out.append([getattr(os.fstatvfs(f.fileno()), k) for k in keep])
    print(json.dumps(out))
    """
)


def run_py(store: Store, script: str, args: list[str], tier: str | None, revalidate: str) -> tuple[str, dict]:
    """Runs a Python script directly on the store or under `tierstore run`; its output and what it sent
    the store."""
    argv = [sys.executable, "-c", script, *args]
    env = {**os.environ, "TIERSTORE_INLINE_MAX": str(INLINE_MAX), "LC_ALL": "C"}
    if tier is not None:
        argv = [sys.executable, "-m", "tierstore.cli", "--source", str(store.mount), "--tier", f"{tier}:64M",
                "run", "--revalidate", revalidate, "--", *argv]  # fmt: skip
    before = store_stats(store.mount)
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd=store.scratch)
    ops = sent(before, store_stats(store.mount))
    assert r.returncode == 0, r.stderr
    return r.stdout, ops


# "never" asserts all that "always" does, and that a warm trusted cache asks the store nothing: "always"
# is `slow` (here and for statfs below).
@pytest.mark.parametrize("revalidate", [pytest.param("always", marks=pytest.mark.slow), "never"])
def test_symlink_answered_from_its_record_and_forgotten_on_change(
    store: Store, tier: str, revalidate: str
) -> None:
    """A symlink inside the source: `lstat`, `readlink`, `realpath`, `stat` and an open through it
    answer as on the store; a warm trusted cache asks the store nothing of it, and replacing the link
    through the shim is seen at once."""
    extra = store.backing / "links"
    shutil.rmtree(extra, ignore_errors=True)
    (extra / "sub").mkdir(parents=True)
    (extra / "one.bin").write_bytes(content(100, 3000))
    (extra / "two.bin").write_bytes(content(101, 5000))
    (extra / "sub" / "link").symlink_to("../one.bin")
    link = str(store.mount / "links" / "sub" / "link")
    direct, _ = run_py(store, LINK_PROBE, [link], None, revalidate)
    for _ in range(2):
        got, ops = run_py(store, LINK_PROBE, [link], tier, revalidate)
        assert json.loads(got) == json.loads(direct)
    if revalidate == "never":
        assert ops == {}, f"a warm trusted cache asked the store about a symlink: {ops}"
    # Replaced through the shim as `ln -sf` does (a new link under a temporary name, renamed over the old
    # one; the stand-in store cannot create links, so the new one is made on its backing directory):
    # the record is forgotten, the new target is read.
    (extra / "sub" / "link.new").symlink_to("../two.bin")
    run_py(store, f"import os; os.rename({link + '.new'!r}, {link!r})", [], tier, revalidate)
    direct, _ = run_py(store, LINK_PROBE, [link], None, revalidate)
    assert json.loads(direct)[0] == "../two.bin"
    got, _ = run_py(store, LINK_PROBE, [link], tier, revalidate)
    assert json.loads(got) == json.loads(direct)
    # Removed through the shim: gone.
    run_py(store, f"import os; os.unlink({link!r})", [], tier, revalidate)
    gone, _ = run_py(store, f"import os; print(os.path.lexists({link!r}))", [], tier, revalidate)
    assert gone.strip() == "False"


@pytest.mark.parametrize("revalidate", [pytest.param("always", marks=pytest.mark.slow), "never"])
def test_statfs_of_the_source(store: Store, tier: str, revalidate: str) -> None:
    """`statvfs`/`fstatvfs` of the source, of a directory and of a file under it (whose descriptor is a
    tier copy) describe the store's file system, as a direct run sees it; a trusted cache asks it once."""
    paths = [str(store.mount), str(store.data / "a"), str(store.data / "small.txt")]
    direct, _ = run_py(store, STATFS_PROBE, paths, None, revalidate)
    for _ in range(2):
        got, ops = run_py(store, STATFS_PROBE, paths, tier, revalidate)
        assert json.loads(got) == json.loads(direct)
    if revalidate == "never":
        assert ops.get("statfs", 0) == 0, f"a warm trusted cache asked the store for statfs: {ops}"
    # A change through the shim forgets the record: the next call asks the store again.
    target = store.mount / "statfs-probe.txt"
    run_py(store, f"open({str(target)!r}, 'w').write('x')", [], tier, revalidate)
    _, ops = run_py(store, STATFS_PROBE, paths, tier, revalidate)
    assert ops.get("statfs", 0) >= 1
    target.unlink()


LIST_PROBE = "import json, os, sys; print(json.dumps(sorted(os.listdir(sys.argv[1]))))"


@pytest.mark.parametrize("revalidate", ["always", "never"])
def test_listing_recorded_and_forgotten_on_change(store: Store, tier: str, revalidate: str) -> None:
    """A directory listing under a trusted cache is asked of the store once, then replayed; a create,
    mkdir, unlink or rename through the shim forgets it, so the next listing shows the change; with
    `always`, a file created behind the cache's back is listed at once."""
    back = store.backing / "listing"
    shutil.rmtree(back, ignore_errors=True)
    back.mkdir()
    (back / "one").write_bytes(b"1")
    src = store.mount / "listing"

    def listed() -> tuple[list[str], dict]:
        got, ops = run_py(store, LIST_PROBE, [str(src)], tier, revalidate)
        direct, _ = run_py(store, LIST_PROBE, [str(src)], None, revalidate)
        assert json.loads(got) == json.loads(direct), "a listing differs from the store's"
        return json.loads(got), ops

    for _ in range(2):
        names, ops = listed()
        assert names == ["one"]
    if revalidate == "never":
        assert ops == {}, f"a warm trusted cache asked the store for a listing: {ops}"
    changes = [
        (f"open({str(src / 'two')!r}, 'w').close()", ["one", "two"]),
        (f"import os; os.mkdir({str(src / 'sub')!r})", ["one", "sub", "two"]),
        (f"import os; os.unlink({str(src / 'one')!r})", ["sub", "two"]),
        (f"import os; os.rename({str(src / 'two')!r}, {str(src / 'three')!r})", ["sub", "three"]),
        # Created relative to a descriptor of the directory (a shadow under a trusted cache): the file
        # lands in the source.
        (
            f"import os; fd = os.open({str(src)!r}, os.O_RDONLY | os.O_DIRECTORY); "
            "os.close(os.open('four', os.O_WRONLY | os.O_CREAT, dir_fd=fd))",
            ["four", "sub", "three"],
        ),
    ]
    for change, expected in changes:
        run_py(store, change, [], tier, revalidate)
        names, ops = listed()
        assert names == expected, f"after {change!r}"
        assert ops.get("readdir", 0) >= 1, "the listing after a change did not reach the store"
    assert (back / "four").is_file()
    if revalidate == "always":
        (back / "five").write_bytes(b"5")
        names, _ = listed()
        assert "five" in names
    shutil.rmtree(back)


XATTR_PROBE = textwrap.dedent(
    """
    import json, os, sys
    out = []
    for p in sys.argv[1:]:
        out.append([(n, os.getxattr(p, n).hex()) for n in sorted(os.listxattr(p))])
        if os.path.isfile(p):
            with open(p, "rb") as f:
                out.append([(n, os.getxattr(f.fileno(), n).hex()) for n in sorted(os.listxattr(f.fileno()))])
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("revalidate", ["always", "never"])
def test_xattrs_recorded_and_forgotten_on_change(store: Store, tier: str, revalidate: str) -> None:
    """Extended attributes of a file (by path and by the descriptor of its tier copy) and of a directory
    answer as on the store; a warm trusted cache asks the store nothing; a change through the shim, by
    path or by descriptor, lands on the store and is seen at once."""
    back = store.backing / "xattrs"
    shutil.rmtree(back, ignore_errors=True)
    (back / "sub").mkdir(parents=True)
    (back / "f.bin").write_bytes(content(200, 4000))
    os.setxattr(back / "f.bin", "user.a", b"1")
    os.setxattr(back / "sub", "user.d", b"dir")
    paths = [str(store.mount / "xattrs" / "f.bin"), str(store.mount / "xattrs" / "sub")]
    f = paths[0]

    def same_as_store() -> dict:
        direct, _ = run_py(store, XATTR_PROBE, paths, None, revalidate)
        got, ops = run_py(store, XATTR_PROBE, paths, tier, revalidate)
        assert json.loads(got) == json.loads(direct)
        return ops

    same_as_store()
    ops = same_as_store()
    if revalidate == "never":
        assert ops == {}, f"a warm trusted cache asked the store about attributes: {ops}"
    else:
        assert ops.get("listxattr", 0) >= 3, f"with always, the store is asked every time: {ops}"
    changes = [
        (f"import os; os.setxattr({f!r}, 'user.b', b'2')", {"user.a": b"1", "user.b": b"2"}),
        # On the descriptor of the tier copy: made on the store's file.
        (
            f"import os\nwith open({f!r}, 'rb') as f: os.setxattr(f.fileno(), 'user.c', b'3')",
            {"user.a": b"1", "user.b": b"2", "user.c": b"3"},
        ),
        (f"import os; os.removexattr({f!r}, 'user.a')", {"user.b": b"2", "user.c": b"3"}),
    ]
    for change, expected in changes:
        run_py(store, change, [], tier, revalidate)
        on_store = {n: os.getxattr(back / "f.bin", n) for n in os.listxattr(back / "f.bin")}
        assert on_store == expected, f"after {change!r}"
        ops = same_as_store()
        assert ops.get("listxattr", 0) >= 1, "the attributes after a change did not come from the store"
    shutil.rmtree(back)
