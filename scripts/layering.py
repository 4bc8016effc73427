#!/usr/bin/env python3
"""The layering check: every module of src/ imports only from modules of a lower rank.

Reads every `crate::` path (in `use` trees and in code) and every `super::` path of every file
under src/, and fails, printing the offending lines, when

- a top-level module imports from a module of a higher rank (RANKS below),
- top-level modules import each other in a circle (possible only within one rank),
- a top-level module of src/ is missing from RANKS (a new module takes a rank when it is added),
- files import each other in a circle (inside one module too).

    python3 scripts/layering.py            # check; exit status 1 on a violation
    python3 scripts/layering.py --graph    # also print the module graph
"""

import os
import re
import sys

# rank -> top-level modules of src/. A module may import from modules of a lower rank only.
RANKS = {
    0: ["error", "clock", "decimal", "throttle", "telemetry", "wire", "runtime"],
    1: ["algorithm", "shed"],
    2: ["key"],
    3: ["store"],
    4: ["response"],
    5: ["policy"],
    6: ["observe"],
    7: ["engine"],
    8: ["layer", "service", "future", "body", "limiter", "grpc", "client", "testing"],
    9: ["replay"],
    # The fleet simulation (tests only) drives whole layers.
    10: ["sim"],
}

RANK_OF = {module: rank for rank, modules in RANKS.items() for module in modules}
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def strip(text):
    """Blanks comments, strings and char literals, keeping line numbers."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and not re.match(r"[A-Za-z0-9_]", text[i - 1:i] or " "):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or text.startswith("'\\", i):
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def use_tree(s, i, prefix):
    """Parses a use tree at s[i:] -> (paths, end)."""
    paths = []
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        if s.startswith("{", i):
            i += 1
            while True:
                sub, i = use_tree(s, i, prefix)
                paths.extend(sub)
                while i < len(s) and s[i].isspace():
                    i += 1
                if s.startswith(",", i):
                    i += 1
                    while i < len(s) and s[i].isspace():
                        i += 1
                    if s.startswith("}", i):
                        return paths, i + 1
                    continue
                if s.startswith("}", i):
                    return paths, i + 1
                return paths, i
        m = re.compile(IDENT + r"|\*").match(s, i)
        if not m:
            paths.append(prefix)
            return paths, i
        prefix = prefix + [m.group(0)]
        i = m.end()
        while i < len(s) and s[i].isspace():
            i += 1
        if s.startswith("::", i):
            i += 2
            continue
        paths.append(prefix)
        m = re.compile(r"\s*as\s+" + IDENT).match(s, i)
        if m:
            i = m.end()
        return paths, i


def module_of(path):
    """src/a/b.rs or src/a/b/mod.rs -> ["a", "b"]."""
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib"):
        rel = rel[:-1]
    return rel


def file_of(segments):
    """The longest prefix of a module path that names a file of src/ -> (file, module)."""
    for end in range(len(segments), -1, -1):
        base = os.path.join(ROOT, *segments[:end])
        for candidate in (base + ".rs", os.path.join(base, "mod.rs")):
            if end and os.path.isfile(candidate):
                return os.path.relpath(candidate, ROOT), segments[:end]
    return "lib.rs", []


def inline_modules(text):
    """The (start, end) spans of the inline modules of a file (`mod tests { … }`): a super::
    inside one names the file's own module."""
    spans = []
    for m in re.finditer(r"\bmod\s+\w+\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        spans.append((m.end(), i))
    return spans


def imports(path):
    """Every (line, module path) a file imports, crate:: and super:: paths resolved."""
    text = strip(open(path, encoding="utf-8").read())
    here = module_of(path)
    inline = inline_modules(text)
    found = []
    for m in re.finditer(r"\b(crate|super|self)\s*::", text):
        start = m.start()
        before = text[max(0, start - 40):start]
        if m.group(1) != "crate" and re.search(r"::\s*$", before):
            continue  # super::super:: is read once, from the first
        line = text.count("\n", 0, start) + 1
        i = m.end()
        if m.group(1) == "crate":
            base = []
        elif m.group(1) == "self":
            base = here
        else:
            # super:: climbs from the file's own module (from an inline module, to it).
            nested = sum(1 for a, b in inline if a <= start < b)
            base = here[:-1] if nested == 0 else here
            while True:
                n = re.compile(r"\s*super\s*::").match(text, i)
                if not n:
                    break
                base = base[:-1]
                i = n.end()
        if re.search(r"\buse\s+(pub\s+)?$", text[max(0, start - 20):start]) or re.search(r"\bpub(\([^)]*\))?\s+use\s+$", text[max(0, start - 30):start]):
            paths, _ = use_tree(text, i, base)
        else:
            n = re.compile(IDENT + r"(\s*::\s*" + IDENT + r")*").match(text, i)
            paths = [base + re.split(r"\s*::\s*", n.group(0))] if n else [base]
        for p in paths:
            found.append((line, [seg for seg in p if seg != "*"]))
    return found


def root_exports():
    """Names lib.rs re-exports (`pub use a::b::Name;`) -> their module path, so that
    `crate::Name` counts as an import of `a`."""
    text = strip(open(os.path.join(ROOT, "lib.rs"), encoding="utf-8").read())
    exports = {}
    for m in re.finditer(r"\bpub\s+use\s+", text):
        paths, _ = use_tree(text, m.end(), [])
        for path in paths:
            if path and path[0] not in ("crate", "self", "super"):
                exports[path[-1]] = path
    return exports


def files():
    for dirpath, _, names in os.walk(ROOT):
        for name in sorted(names):
            if name.endswith(".rs"):
                yield os.path.join(dirpath, name)


def circles(graph):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main():
    problems = []
    module_graph, file_graph, evidence = {}, {}, {}
    tops = set()
    for name in os.listdir(ROOT):
        if name == "lib.rs" or name.startswith("."):
            continue
        if name.endswith(".rs"):
            tops.add(name[:-3])
        elif os.path.isdir(os.path.join(ROOT, name)):
            tops.add(name)
    for top in sorted(tops - set(RANK_OF)):
        problems.append(f"src/{top}: a top-level module without a rank: give it one in scripts/layering.py")
    exports = root_exports()
    for path in files():
        rel = os.path.relpath(path, ROOT)
        here = module_of(path)
        source_lines = open(path, encoding="utf-8").read().split("\n")
        for line, target in imports(path):
            if target and target[0] in exports:
                target = exports[target[0]] + target[1:]
            target_file, _ = file_of(target)
            if target_file != rel:
                file_graph.setdefault(rel, set()).add(target_file)
                evidence.setdefault((rel, target_file), (line, source_lines[line - 1].strip()))
            if not here or not target:
                continue
            src_top, dst_top = here[0], target[0]
            if src_top == dst_top or dst_top not in RANK_OF or src_top not in RANK_OF:
                continue
            module_graph.setdefault(src_top, set()).add(dst_top)
            if RANK_OF[dst_top] > RANK_OF[src_top]:
                problems.append(
                    f"src/{rel}:{line}: `{src_top}` (rank {RANK_OF[src_top]}) imports `{dst_top}` "
                    f"(rank {RANK_OF[dst_top]}): {source_lines[line - 1].strip()}"
                )
    for component in circles(module_graph):
        problems.append("an import circle between top-level modules: " + " -> ".join(component))
    for component in circles(file_graph):
        members = set(component)
        lines = [
            f"    src/{a} -> src/{b} (line {evidence[(a, b)][0]}: {evidence[(a, b)][1]})"
            for a in component
            for b in sorted(file_graph.get(a, ()))
            if b in members
        ]
        problems.append(f"an import circle between {len(component)} files:\n" + "\n".join(lines))
    if "--graph" in sys.argv:
        for module in sorted(module_graph, key=lambda m: (RANK_OF.get(m, 99), m)):
            print(f"{module} ({RANK_OF.get(module)}) -> {', '.join(sorted(module_graph[module]))}")
    if problems:
        print(f"layering: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1
    print(f"layering: {len(list(files()))} files, every import goes down the rank table, no circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
