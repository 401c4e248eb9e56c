"""One Prometheus text from every replica's: each sample gets a ``replica`` label, each metric
family is written once (its HELP and TYPE, then every replica's samples), and the cluster's own
gauges follow."""

__all__ = ["merge"]


def _labelled(line: str, replica: str) -> str:
    """A sample line with ``replica="NAME"`` as its first label."""
    name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
    name, rest = line[:name_end], line[name_end:]
    label = f'replica="{replica}"'
    if rest.startswith("{"):
        inner = rest[1:]
        return f"{name}{{{label}" + ("," + inner if not inner.startswith("}") else inner)
    return f"{name}{{{label}}}{rest}"


def merge(texts: dict[str, bytes], cluster: dict[str, tuple[object, str]]) -> bytes:
    """Every replica's metrics under one family each (see the module docstring); ``cluster``:
    gauge name -> (value, help)."""
    heads: dict[str, list[str]] = {}  # family -> its HELP and TYPE lines
    samples: dict[str, list[str]] = {}  # family -> every replica's samples
    for replica, text in texts.items():
        family = ""
        for line in text.decode().splitlines():
            if not line:
                continue
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    head = heads.setdefault(family, [])
                    if len(head) < 2 and line not in head:
                        head.append(line)
                    samples.setdefault(family, [])
                continue
            samples.setdefault(family, []).append(_labelled(line, replica))
    out: list[str] = []
    for family, lines in samples.items():
        out += heads.get(family, [])
        out += lines
    for name, (value, help_text) in cluster.items():
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
    return ("\n".join(out) + "\n").encode()
