// The official OpenAI Node client against a running kvhandoff router
// (node's TestOfficialOpenAINodeClient runs it): models.list,
// completions.create and chat.completions.create with and without
// stream: true (each streamed text equal to the answer without streaming,
// with n and a stop string too), logprobs, and an unsupported parameter refused as a 400
// naming it.
// Prints one JSON line of what it saw; exits 1 on the first failure.
const OpenAI = require("openai");

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "unused", maxRetries: 0 });
const prompt = "the secret is QX7-zeta; again, the secret is ";

function check(cond, what) {
  if (!cond) {
    console.error("FAIL: " + what);
    process.exit(1);
  }
}

(async () => {
  const seen = {};
  const models = await client.models.list();
  const ids = models.data.map((m) => m.id);
  check(ids.length === 1, "models.list: " + JSON.stringify(ids));
  const model = ids[0];
  seen.model = model;

  const c = await client.completions.create({ model, prompt, max_tokens: 8 });
  check(c.choices.length === 1 && c.choices[0].finish_reason === "length", "completion: " + JSON.stringify(c));
  seen.completion = c.choices[0].text;

  const two = await client.completions.create({ model, prompt, max_tokens: 8, n: 2, stop: ["-"] });
  check(two.choices.length === 2 && two.choices.every((x) => x.finish_reason === "stop"), "n and stop: " + JSON.stringify(two));
  seen.stopped = two.choices[0].text;

  let streamed = "";
  let usage = null;
  const cs = await client.completions.create({ model, prompt, max_tokens: 8, stream: true, stream_options: { include_usage: true } });
  for await (const chunk of cs) {
    for (const ch of chunk.choices) streamed += ch.text || "";
    if (chunk.usage) usage = chunk.usage;
  }
  check(streamed === seen.completion, "streamed completion " + JSON.stringify(streamed) + " != " + JSON.stringify(seen.completion));
  check(usage && usage.completion_tokens === 8, "stream usage: " + JSON.stringify(usage));

  // n and stop streamed: each choice's text is the non-streamed one's, cut at
  // the stop string, which spans tokens here.
  const texts = ["", ""];
  const finishes = [null, null];
  const twoStream = await client.completions.create({ model, prompt, max_tokens: 8, n: 2, stop: ["-ze"], stream: true });
  for await (const chunk of twoStream) {
    for (const ch of chunk.choices) {
      texts[ch.index] += ch.text || "";
      if (ch.finish_reason) finishes[ch.index] = ch.finish_reason;
    }
  }
  check(texts.every((t) => t === seen.stopped) && finishes.every((f) => f === "stop"),
    "streamed n and stop: " + JSON.stringify({ texts, finishes }));

  const messages = [{ role: "user", content: "the code is QX7-zeta; the code is QX7-zeta" }];
  const chat = await client.chat.completions.create({ model, messages, max_tokens: 8 });
  check(chat.choices.length === 1 && chat.choices[0].message.role === "assistant", "chat: " + JSON.stringify(chat));
  seen.chat = chat.choices[0].message.content;

  let chatStreamed = "";
  const chs = await client.chat.completions.create({ model, messages, max_tokens: 8, stream: true });
  for await (const chunk of chs) {
    for (const ch of chunk.choices) chatStreamed += (ch.delta && ch.delta.content) || "";
  }
  check(chatStreamed === seen.chat, "streamed chat " + JSON.stringify(chatStreamed) + " != " + JSON.stringify(seen.chat));

  const lp = await client.completions.create({ model, prompt, max_tokens: 8, logprobs: 2 });
  check(lp.choices[0].logprobs && lp.choices[0].logprobs.tokens.join("") === lp.choices[0].text &&
    lp.choices[0].logprobs.token_logprobs.every((x) => x <= 0), "logprobs: " + JSON.stringify(lp.choices[0]));

  try {
    await client.completions.create({ model, prompt, max_tokens: 8, suffix: "x" });
    check(false, "suffix was not refused");
  } catch (e) {
    check(e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === "suffix" && e.code === "unsupported_parameter",
      "suffix refused as " + e);
    seen.refused = e.param + " " + e.code;
  }
  console.log(JSON.stringify(seen));
})().catch((e) => {
  console.error("FAIL: " + (e && e.stack ? e.stack : e));
  process.exit(1);
});
