/* A jsdom test environment that also has Node's fetch API (jsdom lacks it). */
const JSDOMEnvironment = require('jest-environment-jsdom').default;

class JSDOMWithFetchEnvironment extends JSDOMEnvironment {
  constructor(...args) {
    super(...args);
    this.global.fetch = fetch;
    this.global.Request = Request;
    this.global.Response = Response;
    this.global.Headers = Headers;
    this.global.TextEncoder = TextEncoder;
    this.global.TextDecoder = TextDecoder;
    this.global.structuredClone = structuredClone;
  }
}

module.exports = JSDOMWithFetchEnvironment;
