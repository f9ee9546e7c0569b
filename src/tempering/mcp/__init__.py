"""`tempering.mcp`, where ART has `art.mcp`: MCP•RL (the code is in tempering/integrations/mcp/).

Needs the MCP SDK 2.x (`pip install "tempering[mcp]"`); without it, importing this module raises
MissingDependencyError naming that command.
"""

from ..integrations.mcp import *  # the public names are the implementation's __all__
from ..integrations.mcp import __all__  # noqa: F401
