"""Stage a model checkpoint on a host: read once from the source on a seed host, relayed host to host
down a tree, verified everywhere, resumed after interruption, revisions switched atomically. Runs on
the hosts (stdlib only).

Layout under the model path P (what vLLM serves):
    P                          symlink → P.revisions/<revision>
    P.revisions/<revision>/    the checkpoint; ``.glm-manifest.json`` lists every file with size
                               and sha256, and the commit the revision resolved to where the source
                               says (the hub: always; a branch such as "main" moves, the commit does
                               not); ``.glm-complete`` exists once every file is verified
    P.revisions/.lock          held while a staging runs
    P.revisions/<revision>/.glm-hashes.json   digests by size, mtime, inode: what a staging again reads

    weights.py stage --role seed --source mirror --url URL --revision R --path P [RELAY] [COMMON]
    weights.py stage --role seed --source huggingface --repo ORG/NAME --revision R --path P
                     [--hf-python PY] [--token-file F] [RELAY] [COMMON]
    weights.py stage --role seed --source directory --from DIR [--include REL ...] [--kind GLOB ...]
                     --revision R --path P [RELAY] [COMMON]
    weights.py stage --role peer --peer URL [--peer URL ...] --relay-key-file F --revision R --path P [RELAY]
                     [COMMON]
        RELAY: --name HOST [--serve ADDR:PORT --children HOST,HOST --relay-key-file F] [--stall SECONDS]
        COMMON: [--margin-gb GB] [--timeout SECONDS]
    weights.py stage --source local --path P       (already on every host: verify only)
    weights.py serve --dir D --bind ADDR:PORT          (a static mirror of every file: the simulated model source)
    weights.py verify --revision R --path P [--quick]   (sha256 of every file, or --quick sizes only;
                                                         exit 1 naming bad files)
    weights.py prune --revision R --path P         (remove every other revision)
    weights.py remove --path P                     (remove the checkpoint and its revisions)
    weights.py install --revision R --path P --into DIR [--owner USER] [--include REL ...] [--kind GLOB ...]
                       (copy each file of the staged revision that DIR lacks to DIR/<its path>; exit 1 if
                        not staged, or if the manifest names a file outside the includes and kinds)
    weights.py relay --revision R --path P --bind ADDR:PORT --children HOST,HOST --relay-key-file F
                     [--name HOST] [--stall SECONDS]   (serve a staged revision to the relay children until
                     each has every file or went silent; a process of its own, not a staging; it tells
                     systemd it is ready once it listens: a transient unit of Type=notify)

    --url            the mirror: files under URL/REVISION/, with URL/REVISION/manifest.json
    --hf-python      python of the venv with the hf CLI (default /opt/glm-infra/hf/bin/python)
    --token-file     EnvironmentFile with HF_TOKEN= (read by this program: never on a command line)
    --from           (directory) the folder whose regular files are staged, each at its path under it
    --include        (directory) a path under --from to stage, repeated (default: all of --from); one
                     that is not there is skipped
    --kind           (directory) a pattern of the file names staged (fnmatch of the last component),
                     repeated (default: every regular file); the others are skipped and counted
    --into           (install) the folder the files go to, each at its path in the manifest
    --owner          (install) the user the files and folders it makes are given to (the folder's owner)
    --peer           a host to copy from, repeated: the parent first, then each ancestor up to the seed
    --name           this host's name in the relay (default: its hostname)
    --serve          serve the verified files here while staging (hosts with --children, comma-separated)
    --stall          seconds without progress before a peer leaves the host it copies from (default 120)
    --relay-key-file EnvironmentFile with GLM_RELAY_KEY=, the stack's relay key (needed by a peer and by a
                     host that serves): each request a peer makes is signed with it under its --name, time
                     and a nonce (a relay serves and counts no one else: 401), each progress document goes
                     out signed with it and the request's nonce, and a peer takes only documents so signed
                     (else exit 3: forged, or another process on the port), then every file only with the
                     sha256 that signed document lists
    --margin-gb      free disk to leave beside the checkpoint (default 10)
    --timeout        seconds a peer may take in all (default 86400)

Every host publishes each file in ``.glm-progress.json`` only after verifying it; with ``--serve`` a
thread of the staging serves the published files (never a partial one) to the hosts that copy from
this one (``--children``) and the staging ends once each has said it has every file (``/.glm-done``)
or went silent for ``--stall`` seconds. A peer copies each file as soon as the first of its
``--peer`` hosts (its parent; then each ancestor up to the seed) has published it, verifies it
against the sha256 there, and moves to the next one when its source fails: refused or reset after
it answered, a short body, bad bytes, no progress for ``--stall`` seconds.

The directory source moves what one host built to the others (vLLM's warm-start caches under its
HOME: JIT and autotune caches). The seed copies each regular file of the kinds asked under the includes
into the revision directory, each opened beneath --from without following a symlink (the folder is the
services' own: they could swap a folder for a link meanwhile), hashing the bytes it copies (a cache file
may change while it is read), and writes the manifest anew on every run (paths relative to --from, no
commit); the relay carries it like a checkpoint. ``install`` then puts each file at DIR/<path> on every
host where DIR has none there, the same way beneath DIR, given to --owner: a file the host has is left as
it is (vLLM keys its caches itself).
"""
