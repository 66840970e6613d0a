#!/usr/bin/env node
// A deltaspec client in Node.js, written from protos/deltaspec/v1/*.proto alone: it opens a session to show
// what CreateSession returns, closes it, then streams a generation with Generate (the target runs the
// speculative loop) and prints the tokens as rounds commit, then one JSON line with the whole result.
//
//   npm install
//   node generate.js 127.0.0.1:50051 --prompt "def fib(n):" --max-new-tokens 32
//   node generate.js 127.0.0.1:50051 --prompt-ids 1,2,3 --max-new-tokens 32 --num-draft-tokens 4
//   node generate.js 127.0.0.1:50051 --chat "Write a haiku." --stop "\n\n"
//
// 64-bit integers (head_version, seed, staged_bytes) arrive as decimal strings: proto-loader is asked for
// `longs: String`, since a JavaScript number holds integers exactly only up to 2^53. Send them as strings too.
// Plaintext, so loopback only; give grpc.credentials.createSsl(ca, key, cert) for TLS and a bearer token in
// the metadata (`authorization: Bearer <token>`) where the server asks for them.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "../../protos");

function loadTargetService() {
  const definition = protoLoader.loadSync("deltaspec/v1/target_service.proto", {
    includeDirs: [PROTOS],
    keepCase: true, // field names as in the .proto (prompt_ids, not promptIds)
    longs: String, // uint64 as decimal strings: exact beyond 2^53
    enums: String, // FINISH_REASON_EOS, not 2
    defaults: true, // unset fields read as their proto3 defaults
  });
  return grpc.loadPackageDefinition(definition).deltaspec.v1.TargetService;
}

function parseArgs(argv) {
  const args = { address: argv[0], maxNewTokens: 32, numDraftTokens: 4, stop: [] };
  for (let i = 1; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (flag === "--prompt") args.text = value;
    else if (flag === "--prompt-ids") args.ids = value.split(",").map(Number);
    else if (flag === "--chat") args.chat = value;
    else if (flag === "--stop") args.stop.push(value.replace(/\\n/g, "\n"));
    else if (flag === "--max-new-tokens") args.maxNewTokens = Number(value);
    else if (flag === "--num-draft-tokens") args.numDraftTokens = Number(value);
    else throw new Error(`unknown flag ${flag}`);
  }
  if (!args.address || [args.text, args.ids, args.chat].filter((p) => p !== undefined).length !== 1) {
    throw new Error("usage: generate.js HOST:PORT (--prompt TEXT | --prompt-ids 1,2,3 | --chat TEXT) [...]");
  }
  return args;
}

// Exactly one of prompt_ids, prompt_text and messages; the server refuses anything else (INVALID_ARGUMENT).
function prompt(args) {
  if (args.ids) return { prompt_ids: args.ids };
  if (args.chat) return { messages: [{ role: "user", content: args.chat }] };
  return { prompt_text: args.text };
}

function call(client, method, request) {
  return new Promise((resolve, reject) =>
    client[method](request, (err, reply) => (err ? reject(err) : resolve(reply))));
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const TargetService = loadTargetService();
  const client = new TargetService(args.address, grpc.credentials.createInsecure());

  // A session the client would drive itself (Verify, Commit...); here only opened and closed again.
  const created = await call(client, "CreateSession", { ...prompt(args), sampling: { temperature: 0 } });
  console.error(`session ${created.session_id}: head_version ${JSON.stringify(created.head_version)}, ` +
    `vocab_size ${created.vocab_size}, eos ${created.eos_token_ids}, at most ${created.max_draft_tokens} drafts`);
  await call(client, "CloseSession", { session_id: created.session_id });

  const result = { prompt_ids: [], token_ids: [], text: "" };
  const stream = client.Generate({
    ...prompt(args), max_new_tokens: args.maxNewTokens, num_draft_tokens: args.numDraftTokens,
    stop_strings: args.stop, sampling: { temperature: 0 },
  });
  await new Promise((resolve, reject) => {
    stream.on("data", (msg) => {
      if (msg.prompt_ids.length) result.prompt_ids = msg.prompt_ids; // the first message only
      result.token_ids.push(...msg.token_ids);
      result.text += msg.text;
      if (msg.token_ids.length) console.error(`+ ${JSON.stringify(msg.token_ids)} ${JSON.stringify(msg.text)}`);
      if (msg.finish_reason !== "FINISH_REASON_UNSPECIFIED") { // the last message
        Object.assign(result, { finish_reason: msg.finish_reason, stop_string: msg.stop_string, stats: msg.stats });
      }
    });
    stream.on("error", reject);
    stream.on("end", resolve);
  });
  client.close();
  console.log(JSON.stringify(result));
}

main().catch((err) => {
  // A refusal: err.code is the gRPC status (3 INVALID_ARGUMENT, 5 NOT_FOUND, 9 FAILED_PRECONDITION...);
  // its google.rpc.Status, with the ErrorInfo reason, is in err.metadata's grpc-status-details-bin.
  console.error(`error: ${err.code !== undefined ? `status ${err.code}: ` : ""}${err.details || err.message}`);
  process.exit(1);
});
