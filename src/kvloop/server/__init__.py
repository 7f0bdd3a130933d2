"""The OpenAI-compatible HTTP server (`kvloop serve`): FastAPI routes over an AsyncEngine.

Kept free of imports: `kvloop --help` imports `kvloop.server.cli`, which must not pull
in FastAPI or torch. Import `kvloop.server.app.create_app` to build an app.
"""
