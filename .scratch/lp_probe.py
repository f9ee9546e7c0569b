import asyncio, tempfile
import tempering as art
from tempering.engine import EngineConfig

async def main(prefix):
    b = art.LocalBackend(path=tempfile.mkdtemp(), engine_config=EngineConfig(enable_prefix_caching=prefix))
    model = art.TrainableModel(name="m", project="p", base_model="SmolLM2-135M-Instruct")
    await model.register(b)
    c = model.openai_client()
    kw = dict(model="m", messages=[{"role": "user", "content": "Tell me a short story."}], max_tokens=24, temperature=1.0, seed=11, n=2, stop=["\n\n"])
    outs = [await c.chat.completions.create(**kw) for _ in range(3)]
    for o in outs:
        print(prefix, [round(x, 7) for x in o.choices[0].sampled_logprobs[:4]], o.choices[0].token_ids[:5])
    await b.close()

asyncio.run(main(True)); asyncio.run(main(False))
