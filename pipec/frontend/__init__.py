"""The front end: .pipe text -> AST (parser.py, ast.py) -> per-rank compute orders (expand.py)."""
