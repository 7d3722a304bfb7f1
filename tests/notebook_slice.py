"""The cells of a notebook that some chosen cells need: a backward slice by names.

Why: running a whole notebook to reach its exercises (the student-version test) or its
widgets (the browser test) repeats what nbval runs anyway, and most of a notebook's time
is in cells neither needs (training runs, process jobs, plots). A cell is needed if it is
chosen, or if it binds a name that a needed cell after it reads (a function's body counts
as reading the globals it names). Every earlier binding of such a name is kept, so a name
built up over several cells (``x = ...`` then ``x += ...``) is complete. Cells that only
hold IPython magics (``%matplotlib inline``) are kept: they set the kernel up.

What a name does not show, a slice cannot see: a cell that writes a file or changes an
object in place without rebinding a name. A sliced run then fails loudly in the cell
that misses it, never silently: name such a cell in ``keep``.
"""
from __future__ import annotations

import ast
from collections.abc import Iterable

import nbformat
from IPython.core.inputtransformer2 import TransformerManager

_IPYTHON = TransformerManager()


def parse(source: str) -> ast.Module:
    """A cell as Python: its IPython magics turned into the calls they stand for."""
    return ast.parse(_IPYTHON.transform_cell(source))


class _Names(ast.NodeVisitor):
    """Walks a cell in the order Python runs it, noting which global names it binds and
    which it reads before binding them itself (those come from the cells before)."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.read: set[str] = set()
        self.local: frozenset[str] = frozenset()     # the enclosing function's own names

    def name(self, name: str, store: bool) -> None:
        if name in self.local:
            return
        if store:
            self.bound.add(name)
        elif name not in self.bound:
            self.read.add(name)

    def visit_Name(self, node: ast.Name) -> None:
        self.name(node.id, isinstance(node.ctx, ast.Store))

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            self.name((alias.asname or alias.name).split(".")[0], store=True)

    visit_ImportFrom = visit_Import

    def visit_Assign(self, node: ast.Assign | ast.AnnAssign | ast.NamedExpr) -> None:
        if node.value is not None:                   # the value first, then the targets
            self.visit(node.value)
        for target in getattr(node, "targets", [getattr(node, "target", None)]):
            self.visit(target)

    visit_AnnAssign = visit_NamedExpr = visit_Assign

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):        # ``x += 1`` reads x, then binds it
            self.name(node.target.id, store=False)
        self.visit(node.target)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        for child in (node.iter, node.target, *node.body, *node.orelse):
            self.visit(child)

    visit_AsyncFor = visit_For

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self.visit(item.optional_vars)
        for statement in node.body:
            self.visit(statement)

    visit_AsyncWith = visit_With

    def scope(self, own: set[str], body: list[ast.AST]) -> None:
        """A function's, lambda's, class's or comprehension's body: its own names are
        local; the globals it reads count as read where it is defined."""
        outer, self.local = self.local, self.local | own
        for node in body:
            self.visit(node)
        self.local = outer

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef
                          | ast.Lambda) -> None:
        arguments = node.args
        for outer in [*getattr(node, "decorator_list", []), *arguments.defaults,
                      *filter(None, arguments.kw_defaults)]:
            self.visit(outer)
        parameters = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                      *filter(None, [arguments.vararg, arguments.kwarg])]
        body = node.body if isinstance(node.body, list) else [node.body]
        self.scope({a.arg for a in parameters} | _stored(body), body)
        if not isinstance(node, ast.Lambda):
            self.name(node.name, store=True)

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for outer in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(outer)
        self.scope(_stored(node.body), node.body)
        self.name(node.name, store=True)

    def visit_ListComp(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp
                       | ast.DictComp) -> None:
        first, *rest = node.generators
        self.visit(first.iter)                        # the one part run outside
        inner = [*first.ifs, *rest, *[n for n in (getattr(node, "elt", None),
                                                  getattr(node, "key", None),
                                                  getattr(node, "value", None)) if n]]
        self.scope(_stored([g.target for g in node.generators]), inner)

    visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp


def _stored(nodes: list[ast.AST]) -> set[str]:
    """Every name bound anywhere in ``nodes``: a scope's own names."""
    found: set[str] = set()
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.arg):
                found.add(node.arg)
    return found


def names(source: str) -> tuple[set[str], set[str]]:
    """(the global names a cell binds, the names it reads from the cells before it)."""
    walker = _Names()
    walker.visit(parse(source))
    return walker.bound, walker.read


def bound(source: str) -> set[str]:
    return names(source)[0]


def read(source: str) -> set[str]:
    return names(source)[1]


def only_magics(source: str) -> bool:
    lines = [line.strip() for line in source.splitlines()]
    return all(not line or line.startswith(("%", "#")) for line in lines)


def needed(nb: nbformat.NotebookNode, chosen: Iterable[int],
           keep: Iterable[int] = ()) -> list[int]:
    """Indices of the code cells that the ``chosen`` cells (and the ``keep`` ones) need,
    in order."""
    wanted_cells = set(chosen) | set(keep)
    wanted: set[str] = set()
    picked = []
    for i in range(len(nb.cells) - 1, -1, -1):
        cell = nb.cells[i]
        if cell.cell_type != "code":
            continue
        if i in wanted_cells or only_magics(cell.source) or bound(cell.source) & wanted:
            picked.append(i)
            wanted |= read(cell.source)
    return picked[::-1]


def sliced(nb: nbformat.NotebookNode, chosen: Iterable[int],
           keep: Iterable[int] = ()) -> nbformat.NotebookNode:
    """A copy of ``nb`` with only the code cells ``chosen`` needs (markdown kept), and a
    map from the copy's cell indices to the original's in ``metadata["slice_of"]``."""
    keep_cells = set(needed(nb, chosen, keep))
    copy = nbformat.from_dict(nb)
    pairs = [(i, c) for i, c in enumerate(copy.cells)
             if c.cell_type != "code" or i in keep_cells]
    copy.cells = [c for _, c in pairs]
    copy.metadata["slice_of"] = [i for i, _ in pairs]
    return copy
