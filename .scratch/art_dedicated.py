"""ART-style: dedicated mode through _internal_config, PipelineTrainer, eval on saved steps (CPU, 2 gloo processes)."""
import asyncio, random
import tempering as art
from tempering.local import LocalBackend


async def main():
    backend = LocalBackend(path="/tmp/art-ded", gpus=2, device="cpu")
    model = art.TrainableModel(
        name="ded-agent", project="ded", base_model="SmolLM2-135M-Instruct",
        _internal_config=art.dev.InternalModelConfig(trainer_gpu_ids=[0], inference_gpu_ids=[1]))
    await model.register(backend)
    client = model.openai_client()

    async def rollout(model, scenario, config, step=None):
        a, b = scenario
        messages = [{"role": "user", "content": f"What is {a}+{b}? Answer with just the number."}]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(step) if step is not None else model.name,
            messages=messages, max_completion_tokens=16, temperature=0.7)
        choice = completion.choices[0]
        return art.Trajectory(messages_and_choices=[*messages, choice],
                              reward=float(str(a + b) in (choice.message.content or "")))

    async def evaluate(model, step, config):
        return [await rollout(model, (i, i + 1), config, step=step) for i in range(4)]

    rng = random.Random(0)
    scenarios = [(rng.randint(1, 30), rng.randint(1, 30)) for _ in range(12)]
    pipeline = art.PipelineTrainer(model, backend, rollout, scenarios, eval_fn=evaluate, group_size=4,
                                   min_batch_size=2, max_steps_off_policy=1, max_steps=3, eval_every_n_steps=1,
                                   learning_rate=2e-4)
    result = await pipeline.train()
    print("RESULT", result)
    hist = await backend._read_history(model)
    for row in hist:
        if "offpolicy/policy_age_mean" in row:
            print(row["step"], row.get("train/reward"), row["offpolicy/policy_age_mean"],
                  row.get("data/step_num_trajectories_spanning_update"))
    await backend.close()

asyncio.run(main())
