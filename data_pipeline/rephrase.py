"""The rephrasing hook for knowledge text (K3 rephrases its knowledge corpus with an LLM).

The rewriter is any `module:callable` taking (text, doc_id) and returning a list of rewritten
texts; the pipeline does not ship an LLM. With keep_original the rewrites are added next to the
original as derived documents (origin "rephrased", ids `<id>#rephrase<k>`); without it the first
rewrite replaces the original's text and the rest are added. Derived documents are counted apart
from the input records.
"""

from __future__ import annotations

import dataclasses

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from .config import RephraseConfig
from .filters import load_hook


class Rephrase(PipelineStep):
    name = "rephrase"
    type = "REPHRASE"

    def __init__(self, cfg: RephraseConfig):
        super().__init__()
        self.cfg = cfg

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        rewrite = load_hook(self.cfg.rewriter)
        for doc in data:
            if not doc.metadata.get("rephrase"):
                yield doc
                continue
            with self.track_time():
                texts = [t for t in rewrite(doc.text, doc.id) if t and t.strip()]
            if not self.cfg.keep_original and texts:
                doc.text = texts.pop(0)
                doc.metadata["rephrased"] = True
            yield doc
            for k, text in enumerate(texts):
                self.stat_update("rephrased")
                yield dataclasses.replace(doc, text=text, id=f"{doc.id}#rephrase{k}",
                                          metadata={**doc.metadata, "origin": "rephrased"})
